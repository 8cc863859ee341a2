package transceiver

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	_ "github.com/kvxfer/kvxfer/transport/shm"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

// testCfg is a TCP config with small staging buffers, so that chunking is
// exercised by small requests.
func testCfg(mod ...func(*config.CacheTransceiver)) *config.CacheTransceiver {
	ct := &config.CacheTransceiver{Backend: config.BackendTCP, KVTransferTimeoutMs: 10_000,
		TransferBufferSize: 64 << 10, SendBuffers: 2, RecvBuffers: 1, ZeroCopy: true}
	for _, m := range mod {
		m(ct)
	}
	return ct
}

type inst struct {
	t     *Transceiver
	state layout.CacheState
	pools []*kvcache.Pool
	free  []int
}

// idleWorkers returns the worker goroutines the instance's ranks keep
// waiting for work (see workers.Pool).
func (in *inst) idleWorkers() int {
	n := 0
	for _, r := range in.t.ranks {
		n += r.goes.Idle()
	}
	return n
}

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return nil
}

// newInst builds an instance with blocksPerRank blocks per pool, its
// Options changed by mods. It closes the instance and checks that every
// pool is back at its free count when the test ends.
func newInst(t testing.TB, state layout.CacheState, cfg *config.CacheTransceiver, blocksPerRank int, mods ...func(*Options)) *inst {
	t.Helper()
	n := state.Parallel.NumRanks()
	in := &inst{state: state}
	for r := range n {
		p, err := kvcache.NewPool(state.RankLayout(r), blocksPerRank, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		in.pools = append(in.pools, p)
		in.free = append(in.free, p.FreeBlocks())
	}
	opts := Options{State: state, Pools: in.pools, Logger: testLogger(t)}
	for _, m := range mods {
		m(&opts)
	}
	tr, err := New(context.Background(), cfg, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	in.t = tr
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		stagingFreed(t, tr)
		for r, p := range in.pools {
			if got := p.FreeBlocks(); got != in.free[r] {
				t.Errorf("rank %d: %d free blocks at the end, %d at the start", r, got, in.free[r])
			}
			p.Close()
		}
	})
	return in
}

// ranksOf returns the ranks holding a request of DP group dp.
func (in *inst) ranksOf(dp int) []int {
	rs, _ := in.t.participants(dp)
	out := make([]int, len(rs))
	for i, r := range rs {
		out[i] = r.idx
	}
	return out
}

// alloc allocates nb blocks on every rank of DP group dp.
func (in *inst) alloc(t testing.TB, dp, nb int) [][]kvcache.BlockID {
	t.Helper()
	blocks := make([][]kvcache.BlockID, len(in.pools))
	for _, r := range in.ranksOf(dp) {
		b, err := in.pools[r].Allocate(nb)
		if err != nil {
			t.Fatalf("rank %d: allocate %d blocks: %v", r, nb, err)
		}
		blocks[r] = b
	}
	return blocks
}

func (in *inst) release(t testing.TB, blocks [][]kvcache.BlockID) {
	t.Helper()
	for r, b := range blocks {
		if len(b) > 0 {
			if err := in.pools[r].Release(b...); err != nil {
				t.Errorf("rank %d: release: %v", r, err)
			}
		}
	}
}

// fill writes the reference sharding of logical into the request's blocks.
func (in *inst) fill(t *testing.T, l *layout.Logical, dp int, blocks [][]kvcache.BlockID) {
	t.Helper()
	st := in.state
	st.Parallel.DPRank = dp
	for _, r := range in.ranksOf(dp) {
		shard, err := layout.Shard(l, st, r)
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range blocks[r] {
			copy(in.pools[r].Block(b), shard[i])
		}
	}
}

// verify checks every byte of the request's blocks against the reference.
func (in *inst) verify(t *testing.T, l *layout.Logical, dp int, blocks [][]kvcache.BlockID) {
	t.Helper()
	st := in.state
	st.Parallel.DPRank = dp
	for _, r := range in.ranksOf(dp) {
		shard, err := layout.Shard(l, st, r)
		if err != nil {
			t.Fatal(err)
		}
		for i, b := range blocks[r] {
			if got := in.pools[r].Block(b); !bytes.Equal(got, shard[i]) {
				t.Fatalf("rank %d block %d differs from the reference (first difference at byte %d)", r, i, firstDiff(got, shard[i]))
			}
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// waitDone waits for the request to end, bounded.
func waitDone(t *testing.T, req *Request, within time.Duration) {
	t.Helper()
	req.mu.Lock()
	done := req.done
	req.mu.Unlock()
	select {
	case <-done:
	case <-time.After(within):
		t.Fatalf("request %d still %s after %v", req.ID, req.State(), within)
	}
}

// ended reports whether the request has ended, without waiting.
func ended(req *Request) bool {
	req.mu.Lock()
	done := req.done
	req.mu.Unlock()
	select {
	case <-done:
		return true
	default:
		return false
	}
}

func state(layers, heads, headDim, tpb int, dt kvcache.DType, tp, pp int, mla bool) layout.CacheState {
	kvf := 2
	att := layout.AttentionDefault
	if mla {
		kvf, heads, att = 1, 1, layout.AttentionMLA
	}
	return layout.CacheState{
		Shape:     kvcache.Shape{Layers: layers, KVHeads: heads, HeadDim: headDim, TokensPerBlock: tpb, KVFactor: kvf, DType: dt},
		Parallel:  layout.ParallelConfig{TP: tp, PP: pp, CP: 1},
		Attention: att,
	}
}

// transfer runs one request from sender to gen and checks it bit-exact.
func transfer(t *testing.T, sender, gen *inst, id uint64, tokens int, seed uint64, sendDP, genDP int) Stats {
	t.Helper()
	l, err := layout.NewLogical(sender.state.Shape, tokens)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(seed)
	nb := layout.NumBlocks(tokens, sender.state.Shape.TokensPerBlock)
	cb := sender.alloc(t, sendDP, nb)
	sender.fill(t, l, sendDP, cb)
	creq := &Request{ID: id, Type: ContextOnly, DPRank: sendDP, Blocks: cb}
	if err := sender.t.RespondAndSendAsync(creq); err != nil {
		t.Fatalf("RespondAndSendAsync: %v", err)
	}
	if creq.State() != DisaggContextTransInProgress {
		t.Fatalf("context state %s", creq.State())
	}
	// The transceiver holds its own reference: the caller may let go now.
	sender.release(t, cb)

	gb := gen.alloc(t, genDP, nb)
	greq := &Request{ID: id + 1<<32, Type: GenerationOnly, DPRank: genDP, Blocks: gb,
		ContextPhase: &ContextPhaseParams{CtxRequestID: creq.ContextPhase.CtxRequestID, OpaqueState: creq.ContextPhase.OpaqueState}}
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, greq); err != nil {
		t.Fatalf("receive: %v", err)
	}
	if greq.State() != DisaggGenerationTransComplete {
		t.Fatalf("generation state %s", greq.State())
	}
	waitDone(t, creq, 10*time.Second)
	if creq.State() != DisaggContextComplete || creq.Err() != nil {
		t.Fatalf("context side: %s %v", creq.State(), creq.Err())
	}
	gen.verify(t, l, genDP, gb)
	gen.release(t, gb)
	if got, err := sender.t.CheckContextTransferStatus(cctx, 1); err != nil || len(got) != 1 || got[0] != creq {
		t.Fatalf("CheckContextTransferStatus: %v %v", got, err)
	}
	return greq.Stats()
}

// stagingFreed checks that a closed transceiver's ranks hold no staging
// buffer.
func stagingFreed(t testing.TB, tr *Transceiver) {
	t.Helper()
	for _, r := range tr.ranks {
		if n := r.sendBufs.InUse() + r.recvBufs.InUse(); n != 0 {
			t.Errorf("rank %d: %d staging buffers still in use after Close", r.idx, n)
		}
	}
}
