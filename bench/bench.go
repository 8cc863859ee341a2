package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
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
	Verify            bool
	// Baseline measures the machine's limits in the same run (raw TCP,
	// memory copy) and reports kvxfer's ratio to them.
	Baseline bool
	Env      config.Env
	// Peer is the command that starts the context process; it must run
	// PeerMain. Nil means this executable with the argument "bench-peer".
	Peer    []string
	PeerEnv []string // extra environment of the peer
	// Progress receives one line per batch; nil discards it.
	Progress io.Writer
	Logger   *slog.Logger
}

// Result is what a run measured. Its JSON form is the report of
// `kvxfer bench --json`.
type Result struct {
	Verified      bool     `json:"verified"`
	Bytes         int64    `json:"bytes"`
	GBps          float64  `json:"gbps"`
	P50Ms         float64  `json:"p50_ms"`
	P99Ms         float64  `json:"p99_ms"`
	Backend       string   `json:"backend"`
	Errors        int      `json:"errors"`
	ErrorMessages []string `json:"error_messages,omitempty"`
	Requests      int      `json:"requests"`
	MeasuredS     float64  `json:"measured_s"`
	TransfersPerS float64  `json:"transfers_per_s"`
	Model         string   `json:"model"`
	ISL           int      `json:"isl"`
	DType         string   `json:"dtype"`
	Concurrency   int      `json:"concurrency"`
	Ctx           Par      `json:"ctx"`
	Gen           Par      `json:"gen"`
	MLA           bool     `json:"mla"`
	BytesPerReq   int64    `json:"bytes_per_request"`
	PeerFailed    int      `json:"peer_failed_transfers"`
	PeerLeaked    int      `json:"peer_leaked_blocks"`
	// Baselines and the ratios to them, with Config.Baseline.
	Baselines   *Baselines `json:"baselines,omitempty"`
	RatioRawTCP float64    `json:"ratio_raw_tcp,omitempty"`
	RatioCopy   float64    `json:"ratio_copy,omitempty"`
}

// Par is a parallel layout in the report.
type Par struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
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
		c.Progress = io.Discard
	}
}

// Run runs the benchmark. The returned Result is non-nil whenever the run
// got as far as moving data; err reports a run that could not be set up.
func Run(ctx context.Context, c Config) (*Result, error) {
	c.defaults()
	m, err := LookupModel(c.Model)
	if err != nil {
		return nil, err
	}
	dt, err := kvcache.ParseDType(c.DType)
	if err != nil {
		return nil, err
	}
	cs, err := m.State(dt, c.TokensPerBlock, c.CtxTP, c.CtxPP, c.MLA)
	if err != nil {
		return nil, err
	}
	gs, err := m.State(dt, c.TokensPerBlock, c.GenTP, c.GenPP, c.MLA)
	if err != nil {
		return nil, err
	}
	if err := layout.Compatible(cs, gs); err != nil {
		return nil, err
	}
	nb := layout.NumBlocks(c.ISL, c.TokensPerBlock)
	poolBlocks := nb * c.Concurrency

	peer, err := startPeer(ctx, c, cs, poolBlocks)
	if err != nil {
		return nil, err
	}
	defer peer.stop()

	ct, err := config.NewCacheTransceiver(c.Backend, c.TokensPerBlock, c.Env)
	if err != nil {
		return nil, err
	}
	if c.MaxTokensInBuffer > 0 {
		ct.MaxTokensInBuffer = c.MaxTokensInBuffer
	}
	pools, err := newPools(gs, poolBlocks, transceiver.PoolAllocator(ct))
	if err != nil {
		return nil, err
	}
	defer closePools(pools)
	tr, err := transceiver.New(ctx, ct, transceiver.Options{State: gs, Pools: pools, Logger: c.Logger})
	if err != nil {
		return nil, err
	}
	defer tr.Close()

	res := &Result{Verified: c.Verify, Model: m.Name, ISL: c.ISL, DType: dt.String(), Concurrency: c.Concurrency,
		Ctx: Par{c.CtxTP, c.CtxPP}, Gen: Par{c.GenTP, c.GenPP}, MLA: cs.Attention == layout.AttentionMLA}
	var lat []float64
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
				return res, fmt.Errorf("bench: context side: %w", err)
			}
			blocks := make([][]kvcache.BlockID, len(pools))
			for r, p := range pools {
				if blocks[r], err = p.Allocate(nb); err != nil {
					return res, err
				}
			}
			reqs[i] = &transceiver.Request{ID: id, Type: transceiver.GenerationOnly, Blocks: blocks,
				ContextPhase: &transceiver.ContextPhaseParams{CtxRequestID: id, OpaqueState: opaque}}
			id++
		}
		t0 := time.Now()
		for _, r := range reqs {
			if err := tr.RequestAndReceiveAsync(r); err != nil {
				res.Errors++
				res.ErrorMessages = append(res.ErrorMessages, err.Error())
			}
		}
		if _, err := tr.CheckGenTransferStatus(ctx, -1); err != nil {
			return res, err
		}
		elapsed := time.Since(t0)
		for i, r := range reqs {
			if r.State() == transceiver.DisaggTransError {
				if !slicesContainsErr(res.ErrorMessages, r.Err()) {
					res.Errors++
					res.ErrorMessages = append(res.ErrorMessages, r.Err().Error())
				}
			} else if !warm {
				st := r.Stats()
				res.Bytes += st.Bytes
				res.BytesPerReq = st.Bytes
				res.Backend = st.Backend
				lat = append(lat, float64(st.Duration)/float64(time.Millisecond))
			}
			if c.Verify && r.State() == transceiver.DisaggGenerationTransComplete {
				if err := verify(gs, pools, r.Blocks, c.ISL, seeds[i]); err != nil {
					res.Verified = false
					res.Errors++
					res.ErrorMessages = append(res.ErrorMessages, fmt.Sprintf("request %d: %v", r.ID, err))
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
		phase := "measure"
		if warm {
			phase = "warm-up"
		}
		fmt.Fprintf(c.Progress, "bench: %s %d/%d requests, %.1f ms for %d\n", phase, done, total, float64(elapsed)/1e6, n)
	}
	res.Requests = len(lat)
	res.MeasuredS = measured.Seconds()
	if measured > 0 {
		res.GBps = float64(res.Bytes) / measured.Seconds() / 1e9
		res.TransfersPerS = float64(res.Requests) / measured.Seconds()
	}
	res.P50Ms, res.P99Ms = percentile(lat, 50), percentile(lat, 99)
	if c.Baseline && res.BytesPerReq > 0 {
		raw, err := peer.rawTCP(res.BytesPerReq, 3)
		if err != nil {
			res.Errors++
			res.ErrorMessages = append(res.ErrorMessages, err.Error())
		}
		res.Baselines = &Baselines{RawTCPGBps: raw, CopyGBps: copyGBps(res.BytesPerReq, 3)}
		if raw > 0 {
			res.RatioRawTCP = res.GBps / raw
		}
		res.RatioCopy = res.GBps / res.Baselines.CopyGBps
	}
	bye, err := peer.quit()
	if err != nil {
		res.Errors++
		res.ErrorMessages = append(res.ErrorMessages, err.Error())
	} else {
		res.PeerFailed, res.PeerLeaked = bye.Failed, bye.Leaked
		if bye.Leaked != 0 {
			res.Errors++
			res.ErrorMessages = append(res.ErrorMessages, fmt.Sprintf("context side: %d blocks still held at the end", bye.Leaked))
		}
	}
	if res.Errors > 0 {
		res.Verified = false
	}
	return res, nil
}

func slicesContainsErr(msgs []string, err error) bool {
	for _, m := range msgs {
		if m == err.Error() {
			return true
		}
	}
	return false
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

// peerProc is the context-side child process.
type peerProc struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	stderr *bytes.Buffer
	done   chan error
}

func startPeer(ctx context.Context, c Config, cs layout.CacheState, poolBlocks int) (*peerProc, error) {
	argv := c.Peer
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		argv = []string{exe, "bench-peer"}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), c.PeerEnv...)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	p := &peerProc{cmd: cmd, in: in, out: bufio.NewScanner(out), stderr: &bytes.Buffer{}, done: make(chan error, 1)}
	p.out.Buffer(make([]byte, 1<<16), 1<<22)
	cmd.Stderr = &lockedWriter{w: p.stderr}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start context process %v: %w", argv, err)
	}
	go func() { p.done <- cmd.Wait() }()
	st, _ := cs.MarshalBinary()
	setup, _ := json.Marshal(peerSetup{Backend: c.Backend, State: st, PoolBlocks: poolBlocks, ReferenceFill: c.Verify, MaxTokensInBuf: c.MaxTokensInBuffer})
	if _, err := fmt.Fprintf(in, "%s\n", setup); err != nil {
		p.stop()
		return nil, p.failed("send setup", err)
	}
	m, err := p.read()
	if err != nil {
		p.stop()
		return nil, err
	}
	if m.Op != "ready" {
		p.stop()
		return nil, fmt.Errorf("bench: context process: %s", m.Error)
	}
	return p, nil
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w.Len() > 64<<10 {
		return len(b), nil // keep the tail bounded
	}
	return l.w.Write(b)
}

func (p *peerProc) failed(op string, err error) error {
	tail := strings.TrimSpace(p.stderr.String())
	if len(tail) > 2000 {
		tail = tail[len(tail)-2000:]
	}
	return fmt.Errorf("bench: context process: %s: %v\n%s", op, err, tail)
}

func (p *peerProc) read() (peerMsg, error) {
	var m peerMsg
	if !p.out.Scan() {
		err := p.out.Err()
		if err == nil {
			err = io.ErrUnexpectedEOF
		}
		return m, p.failed("read", err)
	}
	if err := json.Unmarshal(p.out.Bytes(), &m); err != nil {
		return m, p.failed("decode", err)
	}
	return m, nil
}

func (p *peerProc) send(m peerMsg) error {
	b, _ := json.Marshal(m)
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		return p.failed("write", err)
	}
	return nil
}

func (p *peerProc) prepare(id uint64, tokens int, seed uint64) ([]byte, error) {
	if err := p.send(peerMsg{Op: "prepare", ID: id, Tokens: tokens, Seed: seed}); err != nil {
		return nil, err
	}
	m, err := p.read()
	if err != nil {
		return nil, err
	}
	if m.Error != "" {
		return nil, errors.New(m.Error)
	}
	return base64.StdEncoding.DecodeString(m.Opaque)
}

func (p *peerProc) quit() (peerMsg, error) {
	if err := p.send(peerMsg{Op: "quit"}); err != nil {
		return peerMsg{}, err
	}
	return p.read()
}

// stop closes the child's stdin (it exits on EOF) and kills it if it has not
// exited within a few seconds.
func (p *peerProc) stop() {
	p.in.Close()
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// kill ends the child at once (tests of a context process that dies).
func (p *peerProc) kill() { p.cmd.Process.Kill() }
