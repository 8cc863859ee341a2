package bench

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/kvxfer/kvxfer/transport"
)

// The parent (generation side) and the child (context side) speak JSON
// lines over the child's stdin and stdout.

// peerSetup is the first line the parent sends.
type peerSetup struct {
	Backend        string `json:"backend"`
	State          []byte `json:"state"` // layout.CacheState, binary
	PoolBlocks     int    `json:"pool_blocks"`
	ReferenceFill  bool   `json:"reference_fill"`
	MaxTokensInBuf int    `json:"max_tokens_in_buffer,omitempty"`
	// BaselineOnly asks for a process that builds no instance and only
	// serves rawtcp (the baselines' raw TCP stream) until quit.
	BaselineOnly bool `json:"baseline_only,omitempty"`
	// TLS names the context side's files for mutual TLS; nil: none.
	TLS *tlsconf.Files `json:"tls,omitempty"`
	// Role, Ranks and Group make a process of --process-per-rank: a rank
	// (Ranks, of the instance State) of the context ("context", the
	// default) or the generation ("generation") instance, joined with the
	// instance's other processes in a coordinated group.
	Role  string      `json:"role,omitempty"`
	Ranks []int       `json:"ranks,omitempty"`
	Group *groupSetup `json:"group,omitempty"`
}

// groupSetup is the group of a --process-per-rank process.
type groupSetup struct {
	Processes int `json:"processes"`
	// Coordinator is the address of the process hosting rank 0; that
	// process listens on a port of its choosing and tells the parent
	// (op listening), which then starts the others.
	Coordinator string `json:"coordinator,omitempty"`
}

// rankResult is what a generation rank's process saw of one request.
type rankResult struct {
	ID          uint64 `json:"id"`
	Bytes       int64  `json:"bytes"`
	DurationNs  int64  `json:"duration_ns"`
	AgreementNs int64  `json:"agreement_ns"`
	Backend     string `json:"backend,omitempty"`
	Error       string `json:"error,omitempty"`
}

// peerMsg is every later message, both ways.
type peerMsg struct {
	Op        string   `json:"op"` // prepare, prepared, quit, bye, ready, error
	ID        uint64   `json:"id,omitempty"`
	Tokens    int      `json:"tokens,omitempty"`
	Seed      uint64   `json:"seed,omitempty"`
	Opaque    string   `json:"opaque,omitempty"`
	Error     string   `json:"error,omitempty"`
	Endpoints []string `json:"endpoints,omitempty"`
	Leaked    int      `json:"leaked_blocks,omitempty"`
	Failed    int      `json:"failed,omitempty"`
	Bytes     int64    `json:"bytes,omitempty"`
	// --process-per-rank: the results a generation process collected
	// (op collected), and a context process's Stats.Agreement of each
	// context request that completed (op bye).
	Results    []rankResult `json:"results,omitempty"`
	Agreements []int64      `json:"agreements_ns,omitempty"`
}

// PeerMain runs the context side of a benchmark: it reads the setup from in,
// builds a context instance, answers prepare requests by filling blocks and
// handing them to the transceiver, and exits when told to quit or when in
// closes (the parent died). It is what `kvxfer bench-peer` runs.
func PeerMain(ctx context.Context, in io.Reader, out io.Writer, env config.Env, log *slog.Logger) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	enc := json.NewEncoder(out)
	if !sc.Scan() {
		return fmt.Errorf("bench peer: no setup line: %v", sc.Err())
	}
	var setup peerSetup
	if err := json.Unmarshal(sc.Bytes(), &setup); err != nil {
		return fmt.Errorf("bench peer: setup: %w", err)
	}
	if setup.BaselineOnly {
		return peerBaselines(sc, enc)
	}
	if setup.Group != nil {
		return rankMain(ctx, sc, enc, setup, env, log)
	}
	p := &contextPeer{ref: setup.ReferenceFill, log: log}
	defer p.close()
	if err := p.start(ctx, setup, env, enc); err != nil {
		return err
	}
	enc.Encode(peerMsg{Op: "ready", Endpoints: p.tr.Endpoints()})
	return p.serve(ctx, sc, enc)
}

// contextPeer is the context instance of a bench-peer process.
type contextPeer struct {
	st     layout.CacheState
	pools  []*kvcache.Pool
	tr     *transceiver.Transceiver
	ref    bool // fill requests from the naive reference
	log    *slog.Logger
	failed int // context transfers that failed
}

// start builds the pools and the transceiver of setup. A failure that the
// parent could not tell from a dead process is also sent to it.
func (p *contextPeer) start(ctx context.Context, setup peerSetup, env config.Env, enc *json.Encoder) error {
	if err := p.st.UnmarshalBinary(setup.State); err != nil {
		return fmt.Errorf("bench peer: setup state: %w", err)
	}
	ct, err := config.NewCacheTransceiver(setup.Backend, p.st.Shape.TokensPerBlock, env)
	if err != nil {
		return err
	}
	if setup.MaxTokensInBuf > 0 {
		ct.MaxTokensInBuffer = setup.MaxTokensInBuf
	}
	if p.pools, err = newPools(p.st, setup.PoolBlocks, transceiver.PoolAllocator(ct)); err != nil {
		return err
	}
	var tc *transport.TLSConfig
	if setup.TLS != nil {
		c, err := tlsconf.Load(*setup.TLS)
		if err != nil {
			enc.Encode(peerMsg{Op: "error", Error: err.Error()})
			return err
		}
		tc = c.Transport()
	}
	if p.tr, err = transceiver.New(ctx, ct, transceiver.Options{State: p.st, Pools: p.pools, Logger: p.log, TLS: tc}); err != nil {
		enc.Encode(peerMsg{Op: "error", Error: err.Error()})
		return err
	}
	return nil
}

// close closes what start built.
func (p *contextPeer) close() {
	if p.tr != nil {
		p.tr.Close()
	}
	closePools(p.pools)
}

// serve answers the parent's messages until it says quit.
func (p *contextPeer) serve(ctx context.Context, sc *bufio.Scanner, enc *json.Encoder) error {
	for sc.Scan() {
		var m peerMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return fmt.Errorf("bench peer: message: %w", err)
		}
		switch m.Op {
		case "prepare":
			enc.Encode(p.handlePrepare(ctx, m))
			p.drain(ctx, 0)
		case "rawtcp":
			enc.Encode(rawTCP(m))
		case "quit":
			p.drain(ctx, -1)
			leaked := 0
			for _, pl := range p.pools {
				leaked += pl.NumBlocks() - pl.FreeBlocks()
			}
			enc.Encode(peerMsg{Op: "bye", Leaked: leaked, Failed: p.failed})
			return nil
		default:
			return fmt.Errorf("bench peer: unknown op %q", m.Op)
		}
	}
	return sc.Err()
}

// drain collects finished context transfers (at least atLeast, see
// CheckContextTransferStatus) so that they do not pile up.
func (p *contextPeer) drain(ctx context.Context, atLeast int) {
	done, _ := p.tr.CheckContextTransferStatus(ctx, atLeast)
	for _, r := range done {
		if r.Err() != nil {
			p.failed++
			p.log.Warn("context transfer failed", "request", r.ID, "err", r.Err())
		}
	}
}

// handlePrepare answers a prepare message. The generation side may finish a pull
// before this side has released the blocks: like an executor whose pool is
// exhausted, it waits for finished sends before allocating.
func (p *contextPeer) handlePrepare(ctx context.Context, m peerMsg) peerMsg {
	nb := layout.NumBlocks(m.Tokens, p.st.Shape.TokensPerBlock)
	for i := 0; i < 100 && minFree(p.pools) < nb && p.tr.PendingContext() > 0; i++ {
		p.drain(ctx, 1)
	}
	opaque, err := prepare(p.tr, p.st, p.pools, m, p.ref)
	reply := peerMsg{Op: "prepared", ID: m.ID, Opaque: opaque}
	if err != nil {
		reply.Error = err.Error()
	}
	return reply
}

// rawTCP answers a rawtcp message: it sends the bytes of the raw TCP
// baseline.
func rawTCP(m peerMsg) peerMsg {
	reply := peerMsg{Op: "sent"}
	if err := sendRaw(m.Opaque, m.Bytes); err != nil {
		reply.Error = err.Error()
	}
	return reply
}

// peerBaselines is PeerMain for a process that only serves the raw TCP
// baseline.
func peerBaselines(sc *bufio.Scanner, enc *json.Encoder) error {
	enc.Encode(peerMsg{Op: "ready"})
	for sc.Scan() {
		var m peerMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return fmt.Errorf("bench peer: message: %w", err)
		}
		switch m.Op {
		case "rawtcp":
			enc.Encode(rawTCP(m))
		case "quit":
			enc.Encode(peerMsg{Op: "bye"})
			return nil
		default:
			return fmt.Errorf("bench peer: unknown op %q in a baseline-only process", m.Op)
		}
	}
	return sc.Err()
}

func minFree(pools []*kvcache.Pool) int {
	m := pools[0].FreeBlocks()
	for _, p := range pools[1:] {
		m = min(m, p.FreeBlocks())
	}
	return m
}

func newPools(st layout.CacheState, blocks int, alloc kvcache.Allocator) ([]*kvcache.Pool, error) {
	var pools []*kvcache.Pool
	for r := range st.Parallel.NumRanks() {
		p, err := kvcache.NewPool(st.RankLayout(r), blocks, alloc)
		if err != nil {
			closePools(pools)
			return nil, fmt.Errorf("bench: pool of rank %d (%d blocks): %w", r, blocks, err)
		}
		pools = append(pools, p)
	}
	return pools, nil
}

func closePools(pools []*kvcache.Pool) {
	for _, p := range pools {
		p.Close()
	}
}

// prepare plays the context instance's prefill: allocate the request's
// blocks, fill them, hand them to the transceiver.
func prepare(tr *transceiver.Transceiver, st layout.CacheState, pools []*kvcache.Pool, m peerMsg, reference bool) (string, error) {
	return prepareRanks(tr, st, allRanks(st), pools, m, reference)
}

// allRanks lists the ranks of st.
func allRanks(st layout.CacheState) []int {
	out := make([]int, st.Parallel.NumRanks())
	for i := range out {
		out[i] = i
	}
	return out
}

// prepareRanks is prepare for the ranks hosted here: pools[i] is the pool
// of ranks[i].
func prepareRanks(tr *transceiver.Transceiver, st layout.CacheState, ranks []int, pools []*kvcache.Pool, m peerMsg, reference bool) (string, error) {
	nb := layout.NumBlocks(m.Tokens, st.Shape.TokensPerBlock)
	blocks := make([][]kvcache.BlockID, len(pools))
	release := func() {
		for r, b := range blocks {
			if len(b) > 0 {
				pools[r].Release(b...)
			}
		}
	}
	defer release() // the transceiver holds its own references
	for r, p := range pools {
		b, err := p.Allocate(nb)
		if err != nil {
			return "", fmt.Errorf("rank %d: %w", ranks[r], err)
		}
		blocks[r] = b
	}
	if reference {
		l, err := layout.NewLogical(st.Shape, m.Tokens)
		if err != nil {
			return "", err
		}
		l.Fill(m.Seed)
		for r := range pools {
			shard, err := layout.Shard(l, st, ranks[r])
			if err != nil {
				return "", err
			}
			for i, b := range blocks[r] {
				copy(pools[r].Block(b), shard[i])
			}
		}
	} else {
		for r, p := range pools {
			for i, b := range blocks[r] {
				quickFill(p.Block(b), m.Seed^uint64(ranks[r])<<40^uint64(i))
			}
		}
	}
	req := &transceiver.Request{ID: m.ID, Type: transceiver.ContextOnly, Blocks: blocks, NumTokens: m.Tokens}
	if err := tr.RespondAndSendAsync(req); err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(req.ContextPhase.OpaqueState), nil
}

// quickFill writes a cheap non-constant pattern (xorshift64) into b.
func quickFill(b []byte, seed uint64) {
	x := seed | 1
	for len(b) >= 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b, x)
		b = b[8:]
	}
	for i := range b {
		b[i] = byte(x >> (8 * i))
	}
}

// benchTLS makes a CA and a certificate for each side of a run in a new
// private temporary directory: the context process's files, the generation
// side's configs, and a function that removes the directory.
func benchTLS() (prefillFiles tlsconf.Files, gen *transport.TLSConfig, cleanup func(), err error) {
	dir, err := os.MkdirTemp("", "kvxfer-bench-tls-")
	if err != nil {
		return tlsconf.Files{}, nil, nil, fmt.Errorf("bench: TLS: %w", err)
	}
	cleanup = func() { os.RemoveAll(dir) }
	fs, err := tlsconf.WriteCluster(dir, []string{"context", "generation"}, nil, 24*time.Hour, false)
	if err != nil {
		cleanup()
		return tlsconf.Files{}, nil, nil, fmt.Errorf("bench: TLS: %w", err)
	}
	c, err := tlsconf.Load(fs[1])
	if err != nil {
		cleanup()
		return tlsconf.Files{}, nil, nil, fmt.Errorf("bench: TLS: %w", err)
	}
	return fs[0], c.Transport(), cleanup, nil
}
