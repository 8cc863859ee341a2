package bench

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/kvxfer/kvxfer/transport"
)

// Config is one benchmark run.
type Config struct {
	Backend        string // as in cache_transceiver_config.backend: tcp, shm, ucx, auto, default
	Model          string // a preset name (see Models)
	ISL            int    // tokens per request (input sequence length)
	Requests       int    // measured requests
	Warmup         int    // requests before measuring (connections are made lazily)
	Concurrency    int    // requests in flight at once
	CtxTP, CtxPP   int
	GenTP, GenPP   int
	MLA            bool
	DType          string
	TokensPerBlock int
	// MaxTokensInBuffer overrides max_tokens_in_buffer (0: the environment's
	// TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE).
	MaxTokensInBuffer int
	// Verify checks every received byte against the naive reference
	// sharding. Requests larger than the reference allows
	// (layout.MaxLogicalBytes) are not verified: the run reports
	// VerifySkipped instead.
	Verify bool
	Env    config.Env
	// Peer is the command that starts the context process; it must run
	// PeerMain. Nil means this executable with the argument "bench-peer".
	Peer    []string
	PeerEnv []string // extra environment of the peer
	// TLS turns on mutual TLS on both sides' transfer planes (the control
	// connections and the tcp data plane; shm and ucx data are not
	// covered): the run makes a CA and a certificate per side in a private
	// temporary directory, hands the context process its files, and
	// removes them at the end.
	TLS bool
	// Progress is told after every batch of requests; nil discards.
	Progress func(Event)
	Logger   *slog.Logger
}

// Verification outcomes (Result.Verification).
const (
	VerifyOff     = "off"
	VerifyPassed  = "passed"
	VerifyFailed  = "failed"
	VerifySkipped = "skipped (too large for the naive reference)"
	VerifyNotRun  = "not run" // the run failed before anything could be checked
)

// Result is what one run measured: one row of the report.
type Result struct {
	// What the run was asked to do.
	RequestedBackend string `json:"backend_requested"`
	Model            string `json:"model"`
	ISL              int    `json:"isl"`
	DType            string `json:"dtype"`
	Concurrency      int    `json:"concurrency"`
	Ctx              Par    `json:"ctx"`
	Gen              Par    `json:"gen"`
	MLA              bool   `json:"mla"`
	TLS              bool   `json:"tls"` // mutual TLS on the transfer planes

	// What it measured. Backend is what actually carried the data ("tcp",
	// "shm", "ucx(cma)"; several joined by "+" when AUTO chose differently
	// for different requests; "" when nothing moved).
	Backend       string  `json:"backend"`
	Requests      int     `json:"requests"`
	Bytes         int64   `json:"bytes"`
	BytesPerReq   int64   `json:"bytes_per_request"`
	MeasuredS     float64 `json:"measured_s"`
	GBps          float64 `json:"gbps"`
	TransfersPerS float64 `json:"transfers_per_s"`
	P50Ms         float64 `json:"p50_ms"`
	P99Ms         float64 `json:"p99_ms"`
	// Verified is true when verification ran and every byte matched.
	Verified     bool   `json:"verified"`
	Verification string `json:"verification"` // VerifyOff, VerifyPassed, VerifyFailed, VerifySkipped or VerifyNotRun
	// Errors counts failed transfers, failed checks and a failed setup.
	Errors        int      `json:"errors"`
	ErrorMessages []string `json:"error_messages,omitempty"`
	// Error is set when the run could not be set up or was cut short (an
	// unavailable backend, too little memory, a dead context process): its
	// figures are then absent or partial.
	Error      string `json:"error,omitempty"`
	PeerFailed int    `json:"peer_failed_transfers"`
	PeerLeaked int    `json:"peer_leaked_blocks"`
	// Ratios are GBps over each measured baseline that applies to Backend.
	Ratios []Ratio `json:"ratios,omitempty"`
}

// Par is a parallel layout in the report.
type Par struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
}

// OK reports whether the run moved data without any error.
func (r *Result) OK() bool { return r.Errors == 0 && r.Error == "" && r.Verification != VerifyFailed }

// Label names the run in progress lines and charts.
func (r *Result) Label() string {
	return fmt.Sprintf("%s isl=%d c=%d %s", r.BackendLabel(), r.ISL, r.Concurrency, r.DType)
}

// BackendLabel is the requested backend, with "+tls" when the run used
// mutual TLS.
func (r *Result) BackendLabel() string {
	if r.TLS {
		return r.RequestedBackend + "+tls"
	}
	return r.RequestedBackend
}

func (r *Result) fail(err error) {
	r.Errors++
	if r.Error == "" {
		r.Error = err.Error()
	} else {
		r.ErrorMessages = append(r.ErrorMessages, err.Error())
	}
	if r.Verification == VerifyPassed {
		r.Verification = VerifyFailed
	}
	r.Verified = false
}

func (r *Result) addError(msg string) {
	r.Errors++
	if !slices.Contains(r.ErrorMessages, msg) {
		r.ErrorMessages = append(r.ErrorMessages, msg)
	}
}

func (c *Config) defaults() {
	if c.Backend == "" {
		c.Backend = "tcp"
	}
	if c.Model == "" {
		c.Model = "tiny"
	}
	if c.ISL <= 0 {
		c.ISL = 4096
	}
	if c.Requests <= 0 {
		c.Requests = 8
	}
	if c.Warmup < 0 {
		c.Warmup = 0
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 1
	}
	for _, p := range []*int{&c.CtxTP, &c.CtxPP, &c.GenTP, &c.GenPP} {
		if *p <= 0 {
			*p = 1
		}
	}
	if c.DType == "" {
		c.DType = "bf16"
	}
	if c.TokensPerBlock <= 0 {
		c.TokensPerBlock = 32
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Progress == nil {
		c.Progress = func(Event) {}
	}
}

// states returns the context and generation instance states of c.
func (c *Config) states() (m Model, cs, gs layout.CacheState, err error) {
	if m, err = LookupModel(c.Model); err != nil {
		return
	}
	dt, err := kvcache.ParseDType(c.DType)
	if err != nil {
		return
	}
	if cs, err = m.State(dt, c.TokensPerBlock, c.CtxTP, c.CtxPP, c.MLA); err != nil {
		return
	}
	if gs, err = m.State(dt, c.TokensPerBlock, c.GenTP, c.GenPP, c.MLA); err != nil {
		return
	}
	err = layout.Compatible(cs, gs)
	return
}

// newResult is the row of c before anything ran.
func (c *Config) newResult() *Result {
	res := &Result{RequestedBackend: strings.ToLower(c.Backend), Model: strings.ToLower(c.Model), ISL: c.ISL,
		DType: strings.ToLower(c.DType), Concurrency: c.Concurrency, Ctx: Par{c.CtxTP, c.CtxPP}, Gen: Par{c.GenTP, c.GenPP},
		MLA: c.MLA, TLS: c.TLS, Verification: VerifyOff}
	if m, err := LookupModel(c.Model); err == nil {
		res.Model, res.MLA = m.Name, m.MLA || c.MLA
	}
	if dt, err := kvcache.ParseDType(c.DType); err == nil {
		res.DType = dt.String()
	}
	return res
}

// poolBytes is the memory of the pools of every rank of st, blocks blocks
// each.
func poolBytes(st layout.CacheState, blocks int) int64 {
	var n int64
	for r := range st.Parallel.NumRanks() {
		n += st.RankLayout(r).BlockBytes() * int64(blocks)
	}
	return n
}

// Run runs one benchmark. err reports a run that could not be set up (an
// unknown model, a backend this binary lacks, too little memory) and comes
// with a nil Result; a run cut short once data moved (a dead context
// process) returns its partial Result with Result.Error set and a nil err.
func Run(ctx context.Context, c Config) (*Result, error) {
	c.defaults()
	m, cs, gs, err := c.states()
	if err != nil {
		return nil, err
	}
	ct, err := config.NewCacheTransceiver(c.Backend, c.TokensPerBlock, c.Env)
	if err != nil {
		return nil, err
	}
	if c.MaxTokensInBuffer > 0 {
		ct.MaxTokensInBuffer = c.MaxTokensInBuffer
	}
	// Ask before starting the context process, whose own failure would
	// say less.
	if r := ct.Resolve(transceiver.Availability); r.Err != nil {
		return nil, fmt.Errorf("bench: backend %s: %w", strings.ToLower(c.Backend), r.Err)
	}
	nb := layout.NumBlocks(c.ISL, c.TokensPerBlock)
	poolBlocks := nb * c.Concurrency
	verifyOn := c.Verify && verifiable(cs, c.ISL)
	if err := checkMemory(cs, gs, poolBlocks, c.ISL, verifyOn); err != nil {
		return nil, err
	}

	setup := peerSetup{Backend: c.Backend, PoolBlocks: poolBlocks, ReferenceFill: verifyOn, MaxTokensInBuf: c.MaxTokensInBuffer}
	var genTLS *transport.TLSConfig
	if c.TLS {
		ctxFiles, gen, cleanup, err := benchTLS()
		if err != nil {
			return nil, err
		}
		defer cleanup()
		setup.TLS, genTLS = &ctxFiles, gen
	}
	peer, err := startPeer(ctx, c, setup, &cs)
	if err != nil {
		return nil, err
	}
	defer peer.stop()

	pools, err := newPools(gs, poolBlocks, transceiver.PoolAllocator(ct))
	if err != nil {
		return nil, err
	}
	defer closePools(pools)
	tr, err := transceiver.New(ctx, ct, transceiver.Options{State: gs, Pools: pools, Logger: c.Logger, TLS: genTLS})
	if err != nil {
		return nil, err
	}
	defer tr.Close()

	res := c.newResult()
	res.Model, res.MLA = m.Name, cs.Attention == layout.AttentionMLA
	switch {
	case verifyOn:
		res.Verification, res.Verified = VerifyPassed, true
	case c.Verify:
		res.Verification = VerifySkipped
	}
	var lat []float64
	var backends []string
	var measured time.Duration
	total := c.Warmup + c.Requests
	id := uint64(1)
	for done := 0; done < total; {
		n := min(c.Concurrency, total-done)
		warm := done < c.Warmup
		if warm {
			n = min(n, c.Warmup-done)
		}
		reqs := make([]*transceiver.Request, n)
		seeds := make([]uint64, n)
		for i := range n {
			seeds[i] = id*7919 + 17
			opaque, err := peer.prepare(id, c.ISL, seeds[i])
			if err != nil {
				res.fail(fmt.Errorf("bench: context side: %w", err))
				return res, nil
			}
			blocks := make([][]kvcache.BlockID, len(pools))
			for r, p := range pools {
				if blocks[r], err = p.Allocate(nb); err != nil {
					res.fail(err)
					return res, nil
				}
			}
			reqs[i] = &transceiver.Request{ID: id, Type: transceiver.GenerationOnly, Blocks: blocks,
				ContextPhase: &transceiver.ContextPhaseParams{CtxRequestID: id, OpaqueState: opaque}}
			id++
		}
		t0 := time.Now()
		for _, r := range reqs {
			if err := tr.RequestAndReceiveAsync(r); err != nil {
				res.addError(err.Error())
			}
		}
		if _, err := tr.CheckGenTransferStatus(ctx, -1); err != nil {
			res.fail(err)
			return res, nil
		}
		elapsed := time.Since(t0)
		for i, r := range reqs {
			if r.State() == transceiver.DisaggTransError {
				res.addError(r.Err().Error())
			} else {
				st := r.Stats()
				if st.Backend != "" && !slices.Contains(backends, st.Backend) {
					backends = append(backends, st.Backend)
				}
				if !warm {
					res.Bytes += st.Bytes
					res.BytesPerReq = st.Bytes
					lat = append(lat, float64(st.Duration)/float64(time.Millisecond))
				}
			}
			if verifyOn && r.State() == transceiver.DisaggGenerationTransComplete {
				if err := verify(gs, pools, r.Blocks, c.ISL, seeds[i]); err != nil {
					res.addError(fmt.Sprintf("request %d: %v", r.ID, err))
				}
			}
			for rk, b := range r.Blocks {
				pools[rk].Release(b...)
			}
		}
		if !warm {
			measured += elapsed
		}
		done += n
		phase := PhaseMeasure
		if warm {
			phase = PhaseWarmup
		}
		c.Progress(Event{Phase: phase, Done: done, Total: total})
	}
	res.Backend = strings.Join(backends, "+")
	res.Requests = len(lat)
	res.MeasuredS = measured.Seconds()
	if measured > 0 {
		res.GBps = float64(res.Bytes) / measured.Seconds() / 1e9
		res.TransfersPerS = float64(res.Requests) / measured.Seconds()
	}
	res.P50Ms, res.P99Ms = percentile(lat, 50), percentile(lat, 99)
	bye, err := peer.quit()
	if err != nil {
		res.addError(err.Error())
	} else {
		res.PeerFailed, res.PeerLeaked = bye.Failed, bye.Leaked
		if bye.Leaked != 0 {
			res.addError(fmt.Sprintf("context side: %d blocks still held at the end", bye.Leaked))
		}
	}
	if res.Errors > 0 && verifyOn {
		res.Verified, res.Verification = false, VerifyFailed
	}
	return res, nil
}

// verifiable reports whether a request of tokens tokens fits the naive
// reference (layout.NewLogical), which holds it whole.
func verifiable(cs layout.CacheState, tokens int) bool {
	return cs.Shape.BytesPerToken()*int64(tokens) <= layout.MaxLogicalBytes
}

// checkMemory refuses a run that would not fit in the memory available now:
// the pools of both sides (the context process's and this one's) and, with
// verification, the naive reference's copies on both sides.
func checkMemory(cs, gs layout.CacheState, poolBlocks, tokens int, verify bool) error {
	avail, ok := memAvailable()
	if !ok {
		return nil
	}
	ctxB, genB := poolBytes(cs, poolBlocks), poolBytes(gs, poolBlocks)
	need := ctxB + genB
	detail := fmt.Sprintf("context pools %s, generation pools %s", humanBytes(ctxB), humanBytes(genB))
	if verify {
		// Each side holds a logical cache and its shards while it fills
		// or checks a request.
		ref := 4 * cs.Shape.BytesPerToken() * int64(tokens)
		need += ref
		detail += fmt.Sprintf(", reference copies %s", humanBytes(ref))
	}
	if float64(need) > 0.9*float64(avail) {
		return fmt.Errorf("bench: this run needs about %s (%s), more than the %s of memory available; lower --isl or --concurrency",
			humanBytes(need), detail, humanBytes(avail))
	}
	return nil
}

// verify compares a received request with the reference sharding.
func verify(gs layout.CacheState, pools []*kvcache.Pool, blocks [][]kvcache.BlockID, tokens int, seed uint64) error {
	l, err := layout.NewLogical(gs.Shape, tokens)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	l.Fill(seed)
	for r, p := range pools {
		shard, err := layout.Shard(l, gs, r)
		if err != nil {
			return err
		}
		for i, b := range blocks[r] {
			// Whole blocks: past the last token the reference is zero, and
			// so is the context side's block (its fill copies whole
			// reference blocks).
			if !bytes.Equal(p.Block(b), shard[i]) {
				return fmt.Errorf("rank %d block %d differs from the reference", r, i)
			}
		}
	}
	return nil
}
