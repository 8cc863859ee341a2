package bench

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
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
	// ProcessPerRank runs every rank of both instances as an OS process of
	// its own (see perrank.go), the processes of an instance agreeing
	// through a transceiver.CoordinatedGroup, and reports what that
	// agreement cost per request (Result.AgreementP50Us and the rest).
	ProcessPerRank bool
	// MPIBTL is the OpenMPI component that carries a run with backend mpi
	// (MPIBTLVader, the default, or MPIBTLTCP); see mpi.go.
	MPIBTL string
	// MPIRank is the command each rank of a run with backend mpi runs
	// under mpirun; it must call MPIRankMain. Nil means this executable
	// with the arguments "bench mpi-rank".
	MPIRank []string
	// mpiPeer is set in rank 0 of such a run: its connection to the
	// context rank.
	mpiPeer net.Conn
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
	// Ratios are GBps over each measured baseline that applies to Backend:
	// with several rounds (Sweep.Rounds), the best round's over the
	// baseline's best round's.
	Ratios []Ratio `json:"ratios,omitempty"`
	// MedianRoundRatios are, per baseline of Ratios, the median of the
	// per-round ratios (Rounds[k].Ratios: round k's GBps over round k's of
	// the baseline, measured within a minute of each other), the figure
	// the speed targets read. With one round they equal Ratios.
	MedianRoundRatios []Ratio `json:"median_round_ratios,omitempty"`
	// Rounds are the figures of each round, in order (one with a sweep of
	// one round). With several, GBps and TransfersPerS are the best
	// round's; Requests, Bytes, MeasuredS and the error counts are sums
	// over the rounds; P50Ms and P99Ms are of every round's requests
	// pooled.
	Rounds []RunRound `json:"rounds,omitempty"`

	// ProcessPerRank: every rank ran as its own process (see
	// Config.ProcessPerRank). The cost of the instances' cross-process
	// consensus per request is then Stats.Agreement: in a process, from
	// the end of the last rank's part of the request to the request's
	// completion there. AgreementP50Us/P99Us are the generation side's
	// (per measured request, the largest of its processes');
	// CtxAgreement* are the context side's (every context process's
	// figure of every request of the run, warm-up included).
	ProcessPerRank    bool    `json:"process_per_rank,omitempty"`
	AgreementP50Us    float64 `json:"agreement_p50_us,omitempty"`
	AgreementP99Us    float64 `json:"agreement_p99_us,omitempty"`
	CtxAgreementP50Us float64 `json:"ctx_agreement_p50_us,omitempty"`
	CtxAgreementP99Us float64 `json:"ctx_agreement_p99_us,omitempty"`

	// The measured requests' latencies (ms) and agreement costs (µs),
	// which the rounds of a run pool (mergeRuns).
	lat, agree, ctxAgree []float64
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

// DefaultConfig returns a run with every setting at its default: the run
// of `kvxfer bench` without flags. A zero field of a Config passed to Run
// takes the value from here, except Warmup (0 is a choice: no warm-up) and
// the booleans.
func DefaultConfig() Config {
	return Config{Backend: config.BackendTCP.Lower(), Model: "tiny", ISL: 4096, Requests: 8, Warmup: 1, Concurrency: 1,
		CtxTP: 1, CtxPP: 1, GenTP: 1, GenPP: 1, DType: "bf16", TokensPerBlock: config.DefaultTokensPerBlock}
}

func (c *Config) defaults() {
	d := DefaultConfig()
	if c.Backend == "" {
		c.Backend = d.Backend
	}
	c.Backend, _ = backendName(c.Backend)
	if c.Model == "" {
		c.Model = d.Model
	}
	if c.DType == "" {
		c.DType = d.DType
	}
	for _, f := range []struct{ p, d *int }{{&c.ISL, &d.ISL}, {&c.Requests, &d.Requests}, {&c.Concurrency, &d.Concurrency},
		{&c.CtxTP, &d.CtxTP}, {&c.CtxPP, &d.CtxPP}, {&c.GenTP, &d.GenTP}, {&c.GenPP, &d.GenPP}, {&c.TokensPerBlock, &d.TokensPerBlock}} {
		if *f.p <= 0 {
			*f.p = *f.d
		}
	}
	c.Warmup = max(c.Warmup, 0)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Progress == nil {
		c.Progress = func(Event) {}
	}
}

// backendName is a backend as bench's flags and reports spell it: the
// config's name, parsed once, in lower case ("tcp", "auto"). A name that
// does not parse is returned as given, with the error.
func backendName(s string) (string, error) {
	b, err := config.ParseBackend(s)
	if err != nil {
		return s, err
	}
	return b.Lower(), nil
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
	res := &Result{RequestedBackend: c.Backend, Model: strings.ToLower(c.Model), ISL: c.ISL,
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
	ct, err := c.cacheTransceiver()
	if err != nil {
		return nil, err
	}
	if isMPI(c.Backend) && c.mpiPeer == nil {
		return runMPIWorld(ctx, &c)
	}
	if c.ProcessPerRank {
		return runPerRank(ctx, &c, m, cs, gs)
	}
	r := &transferRun{c: &c, gs: gs, nb: layout.NumBlocks(c.ISL, c.TokensPerBlock), verifyOn: c.Verify && verifiable(cs, c.ISL), nextID: 1}
	poolBlocks := r.nb * c.Concurrency
	if err := checkMemory(cs, gs, poolBlocks, c.ISL, r.verifyOn); err != nil {
		return nil, err
	}
	defer r.close()
	if err := r.start(ctx, ct, &cs, poolBlocks); err != nil {
		return nil, err
	}

	r.res = c.measuredResult(m, cs, r.verifyOn)
	if c.runBatches(func(n int, warm bool) bool { return r.batch(ctx, n, warm) }) {
		r.finish()
	}
	return r.res, nil
}

// measuredResult is the row of a run of c on model m with the context
// state cs, its verification as verifyOn says.
func (c *Config) measuredResult(m Model, cs layout.CacheState, verifyOn bool) *Result {
	res := c.newResult()
	res.Model, res.MLA = m.Name, cs.Attention == layout.AttentionMLA
	switch {
	case verifyOn:
		res.Verification, res.Verified = VerifyPassed, true
	case c.Verify:
		res.Verification = VerifySkipped
	}
	return res
}

// runBatches runs the warm-up and then the measured requests of c in
// batches of at most c.Concurrency, reporting progress after each, until
// batch reports a failure (false; it has recorded it). It says whether
// every batch ran.
func (c *Config) runBatches(batch func(n int, warm bool) bool) bool {
	total := c.Warmup + c.Requests
	for done := 0; done < total; {
		n := min(c.Concurrency, total-done)
		warm := done < c.Warmup
		phase := PhaseMeasure
		if warm {
			n, phase = min(n, c.Warmup-done), PhaseWarmup
		}
		if !batch(n, warm) {
			return false
		}
		done += n
		c.Progress(Event{Phase: phase, Done: done, Total: total})
	}
	return true
}

// cacheTransceiver is the generation side's config of c, checked against
// this binary's backends before the context process starts (whose own
// failure would say less).
func (c *Config) cacheTransceiver() (*config.CacheTransceiver, error) {
	ct, err := config.NewCacheTransceiver(c.Backend, c.TokensPerBlock, c.Env)
	if err != nil {
		return nil, err
	}
	if c.MaxTokensInBuffer > 0 {
		ct.MaxTokensInBuffer = c.MaxTokensInBuffer
	}
	if r := ct.Resolve(transceiver.Availability); r.Err != nil {
		return nil, fmt.Errorf("bench: backend %s: %w", c.Backend, r.Err)
	}
	return ct, nil
}

// transferRun is one benchmark run under way: the context process, the generation
// side in this process, and what has been measured so far.
type transferRun struct {
	c        *Config
	gs       layout.CacheState
	nb       int // blocks of one request
	verifyOn bool
	peer     *peerProc
	pools    []*kvcache.Pool
	tr       *transceiver.Transceiver
	undo     []func() // what start set up, in order
	nextID   uint64

	res      *Result
	lat      []float64 // measured requests' latencies, ms
	backends []string  // what carried the data, each once
	measured time.Duration
}

// start starts the context process (with TLS files made for the run when
// asked) and builds the generation side's pools and transceiver. close
// undoes whatever it did, also after an error.
func (r *transferRun) start(ctx context.Context, ct *config.CacheTransceiver, cs *layout.CacheState, poolBlocks int) error {
	setup := peerSetup{Backend: r.c.Backend, PoolBlocks: poolBlocks, ReferenceFill: r.verifyOn, MaxTokensInBuf: r.c.MaxTokensInBuffer}
	var genTLS *transport.TLSConfig
	if r.c.TLS {
		prefillFiles, gen, cleanup, err := benchTLS()
		if err != nil {
			return err
		}
		r.undo = append(r.undo, cleanup)
		setup.TLS, genTLS = &prefillFiles, gen
	}
	var peer *peerProc
	var err error
	if r.c.mpiPeer != nil {
		peer, err = connPeer(r.c.mpiPeer, setup, cs)
	} else {
		peer, err = startPeer(ctx, *r.c, setup, cs)
	}
	if err != nil {
		return err
	}
	r.peer, r.undo = peer, append(r.undo, peer.stop)
	pools, err := newPools(r.gs, poolBlocks, transceiver.PoolAllocator(ct))
	if err != nil {
		return err
	}
	r.pools, r.undo = pools, append(r.undo, func() { closePools(pools) })
	tr, err := transceiver.New(ctx, ct, transceiver.Options{State: r.gs, Pools: pools, Logger: r.c.Logger, TLS: genTLS})
	if err != nil {
		return err
	}
	r.tr, r.undo = tr, append(r.undo, func() { tr.Close() })
	return nil
}

// close undoes start, last step first.
func (r *transferRun) close() {
	for i := len(r.undo) - 1; i >= 0; i-- {
		r.undo[i]()
	}
}

// batch moves n requests at once and accounts for them (in the figures
// unless warm). It returns false when the run cannot go on; res says why.
func (r *transferRun) batch(ctx context.Context, n int, warm bool) bool {
	reqs, seeds, err := r.prepare(n)
	if err != nil {
		r.res.fail(err)
		return false
	}
	t0 := time.Now()
	for _, q := range reqs {
		if err := r.tr.RequestAndReceiveAsync(q); err != nil {
			r.res.addError(err.Error())
		}
	}
	if _, err := r.tr.CheckGenTransferStatus(ctx, -1); err != nil {
		r.res.fail(err)
		return false
	}
	elapsed := time.Since(t0)
	for i, q := range reqs {
		r.account(q, seeds[i], warm)
	}
	if !warm {
		r.measured += elapsed
	}
	return true
}

// prepare has the context process prefill n requests and allocates their
// blocks on this side.
func (r *transferRun) prepare(n int) ([]*transceiver.Request, []uint64, error) {
	reqs := make([]*transceiver.Request, n)
	seeds := make([]uint64, n)
	for i := range n {
		id := r.nextID
		seeds[i] = id*7919 + 17
		opaque, err := r.peer.prepare(id, r.c.ISL, seeds[i])
		if err != nil {
			return nil, nil, fmt.Errorf("bench: context side: %w", err)
		}
		blocks := make([][]kvcache.BlockID, len(r.pools))
		for rk, p := range r.pools {
			if blocks[rk], err = p.Allocate(r.nb); err != nil {
				return nil, nil, err
			}
		}
		reqs[i] = &transceiver.Request{ID: id, Type: transceiver.GenerationOnly, Blocks: blocks,
			ContextPhase: &transceiver.ContextPhaseParams{CtxRequestID: id, OpaqueState: opaque}}
		r.nextID++
	}
	return reqs, seeds, nil
}

// account records one finished request, checks its bytes when verifying,
// and releases its blocks.
func (r *transferRun) account(q *transceiver.Request, seed uint64, warm bool) {
	if q.State() == transceiver.DisaggTransError {
		r.res.addError(q.Err().Error())
	} else {
		st := q.Stats()
		if st.Backend != "" && !slices.Contains(r.backends, st.Backend) {
			r.backends = append(r.backends, st.Backend)
		}
		if !warm {
			r.res.Bytes += st.Bytes
			r.res.BytesPerReq = st.Bytes
			r.lat = append(r.lat, float64(st.Duration)/float64(time.Millisecond))
		}
	}
	if r.verifyOn && q.State() == transceiver.DisaggGenerationTransComplete {
		if err := verify(r.gs, r.pools, q.Blocks, r.c.ISL, seed); err != nil {
			r.res.addError(fmt.Sprintf("request %d: %v", q.ID, err))
		}
	}
	for rk, b := range q.Blocks {
		r.pools[rk].Release(b...)
	}
}

// finish computes the figures and collects the context process's counts.
func (r *transferRun) finish() {
	res := r.res
	if r.c.mpiPeer != nil {
		for i, b := range r.backends {
			r.backends[i] = mpiLabel(b, r.c.MPIBTL)
		}
	}
	res.Backend = strings.Join(r.backends, "+")
	res.Requests = len(r.lat)
	res.MeasuredS = r.measured.Seconds()
	if r.measured > 0 {
		res.GBps = float64(res.Bytes) / r.measured.Seconds() / 1e9
		res.TransfersPerS = float64(res.Requests) / r.measured.Seconds()
	}
	res.P50Ms, res.P99Ms = percentile(r.lat, 50), percentile(r.lat, 99)
	res.lat = r.lat
	bye, err := r.peer.quit()
	if err != nil {
		res.addError(err.Error())
	} else {
		res.PeerFailed, res.PeerLeaked = bye.Failed, bye.Leaked
		if bye.Leaked != 0 {
			res.addError(fmt.Sprintf("context side: %d blocks still held at the end", bye.Leaked))
		}
	}
	if res.Errors > 0 && r.verifyOn {
		res.Verified, res.Verification = false, VerifyFailed
	}
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
	prefillB, genB := poolBytes(cs, poolBlocks), poolBytes(gs, poolBlocks)
	need := prefillB + genB
	detail := fmt.Sprintf("context pools %s, generation pools %s", humanBytes(prefillB), humanBytes(genB))
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
