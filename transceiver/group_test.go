package transceiver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// memGather is an in-memory all-gather of n processes: a round ends when
// every process has contributed; kill makes the round in progress and
// every later one fail, as a collective does when a process dies.
type memGather struct {
	mu   sync.Mutex
	n    int
	cur  *memRound
	dead error
}

type memRound struct {
	in     [][]byte
	got    int
	done   chan struct{}
	result [][]byte // nil: the round failed
}

func newMemGather(n int) *memGather {
	return &memGather{n: n, cur: &memRound{in: make([][]byte, n), done: make(chan struct{})}}
}

func (g *memGather) kill(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead == nil {
		g.dead = err
		close(g.cur.done)
	}
}

// member returns the AllGather of process p.
func (g *memGather) member(p int) AllGather {
	return func(ctx context.Context, b []byte) ([][]byte, error) {
		g.mu.Lock()
		if g.dead != nil {
			g.mu.Unlock()
			return nil, g.dead
		}
		r := g.cur
		r.in[p] = b
		r.got++
		if r.got == g.n {
			r.result = r.in
			g.cur = &memRound{in: make([][]byte, g.n), done: make(chan struct{})}
			close(r.done)
		}
		g.mu.Unlock()
		select {
		case <-r.done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		g.mu.Lock()
		defer g.mu.Unlock()
		if r.result == nil {
			return nil, g.dead
		}
		return r.result, nil
	}
}

// groupMode builds the groups of the n processes of one instance.
type groupMode struct {
	name string
	// make returns the group of each process, a function that starts what
	// drives them once the transceivers exist, and one that kills process
	// p's link to the others (as its death would).
	make func(t testing.TB, n int) (groups []Group, drive func(), kill func(p int))
}

var groupModes = []groupMode{
	{name: "coordinated", make: func(t testing.TB, n int) ([]Group, func(), func(int)) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gs := make([]Group, n)
		for p := range n {
			cfg := CoordinatedConfig{Processes: n, Coordinator: ln.Addr().String()}
			if p == 0 {
				cfg.Listener = ln
			}
			g, err := NewCoordinatedGroup(cfg)
			if err != nil {
				t.Fatal(err)
			}
			gs[p] = g
		}
		kill := func(p int) { gs[p].leave(errors.New("killed by the test")) }
		return gs, func() {}, kill
	}},
	{name: "gather", make: func(t testing.TB, n int) ([]Group, func(), func(int)) {
		mg := newMemGather(n)
		gs := make([]Group, n)
		for p := range n {
			gs[p] = NewGatherGroup(p, n)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		t.Cleanup(func() { cancel(); mg.kill(errors.New("test over")); wg.Wait() })
		drive := func() {
			for p := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					gs[p].(*GatherGroup).Run(ctx, mg.member(p), 200*time.Microsecond)
				}()
			}
		}
		kill := func(int) { mg.kill(errors.New("a process died")) }
		return gs, drive, kill
	}},
}

// split is an instance whose ranks each run in a Transceiver of their own
// (a process each), joined by a group.
type split struct {
	state layout.CacheState
	procs []*inst // procs[r] hosts rank r only
	kill  func(p int)
}

// newSplit builds an instance of state with one process per rank.
func newSplit(t *testing.T, mode groupMode, state layout.CacheState, cfg *config.CacheTransceiver, blocksPerRank int, mods ...func(*Options)) *split {
	t.Helper()
	n := state.Parallel.NumRanks()
	groups, drive, kill := mode.make(t, n)
	s := &split{state: state, procs: make([]*inst, n), kill: kill}
	drive()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for r := range n {
		p, err := kvcache.NewPool(state.RankLayout(r), blocksPerRank, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		in := &inst{state: state, pools: []*kvcache.Pool{p}, free: []int{p.FreeBlocks()}}
		s.procs[r] = in
		opts := Options{State: state, Pools: in.pools, Ranks: []int{r}, Group: groups[r], Logger: testLogger(t)}
		for _, m := range mods {
			m(&opts)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			in.t, errs[r] = New(ctx, cfg, opts)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("New of rank %d: %v", r, err)
		}
	}
	for _, in := range s.procs {
		select {
		case <-in.t.Joined():
		case <-time.After(10 * time.Second):
			t.Fatal("the group did not join within 10s")
		}
	}
	t.Cleanup(func() {
		for r, in := range s.procs {
			if err := in.t.Close(); err != nil {
				t.Errorf("Close of rank %d: %v", r, err)
			}
			stagingFreed(t, in.t)
			if got := in.pools[0].FreeBlocks(); got != in.free[0] {
				t.Errorf("rank %d: %d free blocks at the end, %d at the start", r, got, in.free[0])
			}
			in.pools[0].Close()
		}
	})
	return s
}

// respond hands a context request of tokens tokens, filled from seed, to
// every process; it returns the requests (one per process) and the
// logical cache.
func (s *split) respond(t *testing.T, id uint64, tokens int, seed uint64) ([]*Request, *layout.Logical) {
	t.Helper()
	l, err := layout.NewLogical(s.state.Shape, tokens)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(seed)
	nb := layout.NumBlocks(tokens, s.state.Shape.TokensPerBlock)
	reqs := make([]*Request, len(s.procs))
	for r, in := range s.procs {
		b, err := in.pools[0].Allocate(nb)
		if err != nil {
			t.Fatal(err)
		}
		shard, err := layout.Shard(l, s.state, r)
		if err != nil {
			t.Fatal(err)
		}
		for i, blk := range b {
			copy(in.pools[0].Block(blk), shard[i])
		}
		reqs[r] = &Request{ID: id, Type: ContextOnly, NumTokens: tokens, Blocks: [][]kvcache.BlockID{b}}
		if err := in.t.RespondAndSendAsync(reqs[r]); err != nil {
			t.Fatalf("rank %d: RespondAndSendAsync: %v", r, err)
		}
		in.pools[0].Release(b...)
	}
	return reqs, l
}

// receive pulls into every process of s from opaque, as generation
// request id, and returns the requests and their blocks.
func (s *split) receive(t *testing.T, id uint64, tokens int, opaque []byte) ([]*Request, [][]kvcache.BlockID) {
	t.Helper()
	nb := layout.NumBlocks(tokens, s.state.Shape.TokensPerBlock)
	reqs := make([]*Request, len(s.procs))
	blocks := make([][]kvcache.BlockID, len(s.procs))
	for r, in := range s.procs {
		b, err := in.pools[0].Allocate(nb)
		if err != nil {
			t.Fatal(err)
		}
		blocks[r] = b
		reqs[r] = &Request{ID: id, Type: GenerationOnly, NumTokens: tokens, Blocks: [][]kvcache.BlockID{b},
			ContextPhase: &ContextPhaseParams{CtxRequestID: 0, OpaqueState: opaque}}
		if err := in.t.RequestAndReceiveAsync(reqs[r]); err != nil {
			t.Fatalf("rank %d: RequestAndReceiveAsync: %v", r, err)
		}
	}
	return reqs, blocks
}

func waitAll(t *testing.T, reqs []*Request, within time.Duration) {
	t.Helper()
	for _, r := range reqs {
		waitDone(t, r, within)
	}
}

// TestGroupTransfer: a context instance of two processes (TP2, a rank
// each) and a generation instance of two (TP2 → TP1 and TP1 → TP2 both
// covered): the cache moves bit-exact, the requests complete on every
// process, and the opaque states of every context process are the same
// but for their nonces (same token, same endpoints).
func TestGroupTransfer(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg()
			ctxSt := state(4, 4, 16, 8, kvcache.FP16, 2, 1, false)
			genSt := state(4, 4, 16, 8, kvcache.FP16, 1, 1, false)
			ctxInst := newSplit(t, mode, ctxSt, cfg, 32)
			gen := newInst(t, genSt, cfg, 32)
			for i, tokens := range []int{40, 8, 100} {
				id := uint64(100 + i)
				creqs, l := ctxInst.respond(t, id, tokens, uint64(7+i))
				var o0, o1 OpaqueState
				if err := o0.UnmarshalBinary(creqs[0].ContextPhase.OpaqueState); err != nil {
					t.Fatal(err)
				}
				if err := o1.UnmarshalBinary(creqs[1].ContextPhase.OpaqueState); err != nil {
					t.Fatal(err)
				}
				if o0.Token != o1.Token || !slices.Equal(o0.Endpoints, o1.Endpoints) || o0.RequestID != id {
					t.Fatalf("the processes' opaque states disagree: %+v / %+v", o0, o1)
				}
				nb := layout.NumBlocks(tokens, 8)
				gb := gen.alloc(t, 0, nb)
				greq := &Request{ID: id + 1000, Type: GenerationOnly, Blocks: gb, NumTokens: tokens,
					ContextPhase: &ContextPhaseParams{CtxRequestID: id, OpaqueState: creqs[1].ContextPhase.OpaqueState}}
				cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				if err := gen.t.RequestAndReceiveSync(cctx, greq); err != nil {
					cancel()
					t.Fatalf("receive: %v", err)
				}
				cancel()
				gen.verify(t, l, 0, gb)
				gen.release(t, gb)
				waitAll(t, creqs, 10*time.Second)
				for r, c := range creqs {
					if c.State() != DisaggContextComplete || c.Err() != nil {
						t.Fatalf("rank %d: context request %s %v", r, c.State(), c.Err())
					}
					if st := c.Stats(); st.Bytes == 0 || st.Agreement < 0 {
						t.Fatalf("rank %d: stats %+v", r, st)
					}
				}
				for r, in := range ctxInst.procs {
					got, err := in.t.CheckContextTransferStatus(context.Background(), 1)
					if err != nil || len(got) != 1 || got[0] != creqs[r] {
						t.Fatalf("rank %d: CheckContextTransferStatus: %v %v", r, got, err)
					}
				}
			}
		})
	}
}

// TestGroupReceive: the generation instance is split (TP2, a process a
// rank) and pulls from a context instance in one process: both processes
// derive the same pull id and the context side serves it as one attempt.
func TestGroupReceive(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg()
			ctxSt := state(2, 4, 16, 8, kvcache.BF16, 1, 1, false)
			genSt := state(2, 4, 16, 8, kvcache.BF16, 2, 1, false)
			sender := newInst(t, ctxSt, cfg, 32)
			gen := newSplit(t, mode, genSt, cfg, 32)
			const tokens = 50
			l, err := layout.NewLogical(ctxSt.Shape, tokens)
			if err != nil {
				t.Fatal(err)
			}
			l.Fill(3)
			cb := sender.alloc(t, 0, layout.NumBlocks(tokens, 8))
			sender.fill(t, l, 0, cb)
			creq := &Request{ID: 5, Type: ContextOnly, Blocks: cb, NumTokens: tokens}
			if err := sender.t.RespondAndSendAsync(creq); err != nil {
				t.Fatal(err)
			}
			sender.release(t, cb)
			greqs, gb := gen.receive(t, 77, tokens, creq.ContextPhase.OpaqueState)
			waitAll(t, greqs, 20*time.Second)
			for r, g := range greqs {
				if g.State() != DisaggGenerationTransComplete {
					t.Fatalf("rank %d: %s %v", r, g.State(), g.Err())
				}
				st := genSt
				shard, err := layout.Shard(l, st, r)
				if err != nil {
					t.Fatal(err)
				}
				for i, b := range gb[r] {
					if got := gen.procs[r].pools[0].Block(b); string(got) != string(shard[i]) {
						t.Fatalf("rank %d block %d differs from the reference", r, i)
					}
				}
				gen.procs[r].pools[0].Release(gb[r]...)
			}
			waitDone(t, creq, 10*time.Second)
			if creq.State() != DisaggContextComplete {
				t.Fatalf("context request %s %v", creq.State(), creq.Err())
			}
		})
	}
}

// TestGroupCancelSpreads: a cancel on one process fails the request on
// every process of the instance, at once (not at the deadline).
func TestGroupCancelSpreads(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			ctxInst := newSplit(t, mode, state(2, 4, 16, 8, kvcache.FP16, 2, 1, false), testCfg(), 16)
			creqs, _ := ctxInst.respond(t, 9, 16, 1)
			if !ctxInst.procs[1].t.Cancel(creqs[1]) {
				t.Fatal("Cancel on rank 1: nothing in flight")
			}
			start := time.Now()
			waitAll(t, creqs, 3*time.Second)
			for r, c := range creqs {
				if !errors.Is(c.Err(), ErrCanceled) {
					t.Fatalf("rank %d: %s %v, want ErrCanceled", r, c.State(), c.Err())
				}
			}
			t.Logf("cancel reached every process in %v", time.Since(start))
		})
	}
}

// TestGroupProcessDies: a process of the instance dies while a request is
// held; the request fails on the others within a bound, far below the
// transfer deadline, and they refuse new requests only if the group is
// gone.
func TestGroupProcessDies(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = 60_000 })
			ctxInst := newSplit(t, mode, state(4, 4, 16, 8, kvcache.FP16, 2, 2, false), cfg, 16)
			creqs, _ := ctxInst.respond(t, 11, 16, 1)
			start := time.Now()
			ctxInst.kill(3)
			waitAll(t, creqs[:3], 5*time.Second)
			for r, c := range creqs[:3] {
				if c.State() != DisaggTransError || !errors.Is(c.Err(), ErrGroupLost) {
					t.Fatalf("rank %d: %s %v, want ErrGroupLost", r, c.State(), c.Err())
				}
			}
			t.Logf("the death reached the others in %v", time.Since(start))
		})
	}
}

// TestGroupCoordinatorDies: the coordinator's process closes; the others
// fail what is in flight with ErrGroupLost and refuse new requests with
// it, without hanging.
func TestGroupCoordinatorDies(t *testing.T) {
	mode := groupModes[0]
	ctxInst := newSplit(t, mode, state(2, 4, 16, 8, kvcache.FP16, 2, 1, false), testCfg(), 16)
	creqs, _ := ctxInst.respond(t, 12, 16, 1)
	if err := ctxInst.procs[0].t.Close(); err != nil {
		t.Fatal(err)
	}
	waitAll(t, creqs, 5*time.Second)
	if !errors.Is(creqs[1].Err(), ErrGroupLost) {
		t.Fatalf("rank 1: %s %v, want ErrGroupLost", creqs[1].State(), creqs[1].Err())
	}
	p := ctxInst.procs[1]
	b, err := p.pools[0].Allocate(1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.pools[0].Release(b...)
	err = p.t.RespondAndSendAsync(&Request{ID: 13, Type: ContextOnly, Blocks: [][]kvcache.BlockID{b}})
	if !errors.Is(err, ErrGroupLost) {
		t.Fatalf("new request after the coordinator died: %v, want ErrGroupLost", err)
	}
}

// TestGroupOptions: the options that do not make an instance are refused
// with a clear error.
func TestGroupOptions(t *testing.T) {
	cfg := testCfg()
	st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
	pool := func(r int) *kvcache.Pool {
		p, err := kvcache.NewPool(st.RankLayout(r), 2, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}
	for _, tc := range []struct {
		name string
		opts Options
		want string
	}{
		{"part without group", Options{State: st, Ranks: []int{1}, Pools: []*kvcache.Pool{pool(1)}}, "Options.Group is required"},
		{"whole with group", Options{State: st, Ranks: []int{0, 1}, Pools: []*kvcache.Pool{pool(0), pool(1)}, Group: NewGatherGroup(0, 1)}, "leave it nil"},
		{"rank out of range", Options{State: st, Ranks: []int{2}, Pools: []*kvcache.Pool{pool(0)}, Group: NewGatherGroup(0, 2)}, "ranks 0..1"},
		{"descending", Options{State: st, Ranks: []int{1, 0}, Pools: []*kvcache.Pool{pool(1), pool(0)}}, "ascending"},
		{"pools for other ranks", Options{State: st, Ranks: []int{1}, Pools: []*kvcache.Pool{pool(0), pool(1)}, Group: NewGatherGroup(1, 2)}, "2 pools for 1 ranks"},
		{"empty", Options{State: st, Ranks: []int{}, Pools: nil, Group: NewGatherGroup(1, 2)}, "Options.Ranks is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := New(context.Background(), cfg, tc.opts)
			if err == nil {
				tr.Close()
				t.Fatalf("New: no error, want %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New: %v, want %q", err, tc.want)
			}
		})
	}
}

// TestGroupJoinBad: joins that do not make the instance are refused.
func TestGroupJoinBad(t *testing.T) {
	for _, tc := range []struct {
		name  string
		joins []groupJoin
		want  string
	}{
		{"missing rank", []groupJoin{{ranks: []int{0}, endpoints: []string{"a"}}}, "no process hosts rank 1"},
		{"twice", []groupJoin{{ranks: []int{0, 1}, endpoints: []string{"a", "b"}}, {ranks: []int{1}, endpoints: []string{"c"}}}, "hosted by processes 0 and 1"},
		{"out of range", []groupJoin{{ranks: []int{0, 1, 2}, endpoints: []string{"a", "b", "c"}}}, "hosts rank 2"},
		{"no endpoints", []groupJoin{{ranks: []int{0, 1}}}, "2 ranks and 0 endpoints"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := joinGroup(tc.joins, 2)
			if !errors.Is(err, ErrBadGroup) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("joinGroup: %v, want ErrBadGroup with %q", err, tc.want)
			}
		})
	}
	info, err := joinGroup([]groupJoin{{ranks: []int{1}, endpoints: []string{"b"}, share: [32]byte{1}}, {ranks: []int{0}, endpoints: []string{"a"}, share: [32]byte{2}}}, 2)
	if err != nil || !slices.Equal(info.endpoints, []string{"a", "b"}) || !slices.Equal(info.owner, []int{1, 0}) {
		t.Fatalf("joinGroup: %+v %v", info, err)
	}
	swapped, _ := joinGroup([]groupJoin{{ranks: []int{0}, endpoints: []string{"a"}, share: [32]byte{2}}, {ranks: []int{1}, endpoints: []string{"b"}, share: [32]byte{1}}}, 2)
	if swapped.secret == info.secret {
		t.Fatal("the instance secret does not depend on the process order")
	}
}

// TestDerivations: the token and the pull id are functions of their
// inputs under the instance secret; a change of any input changes them.
func TestDerivations(t *testing.T) {
	s1, s2 := [32]byte{1}, [32]byte{2}
	base := deriveToken(s1, 7, 100)
	if base != deriveToken(s1, 7, 100) {
		t.Fatal("deriveToken is not deterministic")
	}
	for _, other := range [][16]byte{deriveToken(s2, 7, 100), deriveToken(s1, 8, 100), deriveToken(s1, 7, 101)} {
		if other == base {
			t.Fatal("deriveToken ignores an input")
		}
	}
	p := derivePullID(s1, 7, []byte("state"))
	if p == 0 || p != derivePullID(s1, 7, []byte("state")) {
		t.Fatal("derivePullID is 0 or not deterministic")
	}
	for _, other := range []uint64{derivePullID(s2, 7, []byte("state")), derivePullID(s1, 8, []byte("state")), derivePullID(s1, 7, []byte("statf"))} {
		if other == p {
			t.Fatal("derivePullID ignores an input")
		}
	}
}

// fakeMember records what a group applies.
type fakeMember struct {
	mu     sync.Mutex
	log    []string
	joins  []groupJoin
	lostBy error
}

func (f *fakeMember) joined(all []groupJoin) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.joins = all
	return nil
}
func (f *fakeMember) apply(evs []instEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range evs {
		f.log = append(f.log, fmt.Sprintf("%+v", ev))
	}
}
func (f *fakeMember) lost(err error) instEvent {
	f.mu.Lock()
	f.lostBy = err
	f.mu.Unlock()
	return ranksLostEvent{err: err}
}
func (f *fakeMember) snapshot() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.log)
}

// TestGroupTotalOrder: every process of a group applies the same log, in
// which each process's events keep the order it published them in, in
// both modes.
func TestGroupTotalOrder(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			const n, per = 3, 200
			groups, drive, _ := mode.make(t, n)
			drive()
			members := make([]*fakeMember, n)
			var wg sync.WaitGroup
			for p := range n {
				members[p] = &fakeMember{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					if err := groups[p].start(ctx, members[p], groupJoin{ranks: []int{p}, endpoints: []string{fmt.Sprint("e", p)}}); err != nil {
						t.Errorf("start %d: %v", p, err)
					}
				}()
			}
			wg.Wait()
			// The gather group joins at its first round.
			deadline := time.Now().Add(10 * time.Second)
			for p := range n {
				for {
					members[p].mu.Lock()
					ok := members[p].joins != nil
					members[p].mu.Unlock()
					if ok || time.Now().After(deadline) {
						break
					}
					time.Sleep(time.Millisecond)
				}
			}
			for p := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range per {
						groups[p].publish(attemptEndEvent{key: instKey{sideSend, uint64(i)}, rank: p, attempt: uint64(i + 1)})
					}
				}()
			}
			wg.Wait()
			for p := range n {
				for len(members[p].snapshot()) < n*per && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
			}
			want := members[0].snapshot()
			if len(want) != n*per {
				t.Fatalf("process 0 applied %d events, want %d", len(want), n*per)
			}
			for p := 1; p < n; p++ {
				if got := members[p].snapshot(); !slices.Equal(got, want) {
					t.Fatalf("process %d applied another log than process 0 (%d vs %d events)", p, len(got), len(want))
				}
			}
			for p := range n {
				next := 0
				for _, line := range want {
					if strings.Contains(line, fmt.Sprintf("rank:%d ", p)) {
						if !strings.Contains(line, fmt.Sprintf("id:%d}", next)) {
							t.Fatalf("process %d's events out of order: %s, want id %d", p, line, next)
						}
						next++
					}
				}
			}
			for _, g := range groups {
				g.close()
			}
		})
	}
}

// TestGroupHostileStates: with a context instance split over processes,
// whose tokens are derived from the instance secret rather than drawn per
// request, an attacker holding opaque states gets no further than with
// random tokens: the token of one request does not open another, nor the
// same request id of another instance, and a state is refused once its
// request completed. The genuine pulls still succeed.
func TestGroupHostileStates(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg()
			st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
			a := newSplit(t, mode, st, cfg, 32)
			b := newSplit(t, mode, st, cfg, 32)
			gen := newInst(t, state(2, 4, 16, 8, kvcache.FP16, 1, 1, false), cfg, 32)
			const tokens = 16
			r1, _ := a.respond(t, 1, tokens, 1)
			r2, _ := a.respond(t, 2, tokens, 2)
			rb, _ := b.respond(t, 1, tokens, 3)
			decode := func(enc []byte) OpaqueState {
				var o OpaqueState
				if err := o.UnmarshalBinary(enc); err != nil {
					t.Fatal(err)
				}
				return o
			}
			o1, o2, ob := decode(r1[0].ContextPhase.OpaqueState), decode(r2[0].ContextPhase.OpaqueState), decode(rb[0].ContextPhase.OpaqueState)
			if o1.Token == o2.Token || o1.Token == ob.Token {
				t.Fatal("two requests, or two instances' requests of one id, share a token")
			}
			nextGen := uint64(1000)
			pull := func(o OpaqueState) error {
				t.Helper()
				enc, err := o.MarshalBinary()
				if err != nil {
					t.Fatal(err)
				}
				nextGen++
				blocks := gen.alloc(t, 0, 2)
				defer gen.release(t, blocks)
				greq := &Request{ID: nextGen, Type: GenerationOnly, Blocks: blocks, ContextPhase: &ContextPhaseParams{OpaqueState: enc}}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				return gen.t.RequestAndReceiveSync(ctx, greq)
			}
			// Request 2 with the token of request 1.
			forged := o2
			forged.Token = o1.Token
			if err := pull(forged); !errors.Is(err, ErrRefused) {
				t.Fatalf("request 2 with request 1's token: %v, want ErrRefused", err)
			}
			// Instance b's request 1 with instance a's token of request 1.
			forged = ob
			forged.Token = o1.Token
			if err := pull(forged); !errors.Is(err, ErrRefused) {
				t.Fatalf("instance b's request 1 with instance a's token: %v, want ErrRefused", err)
			}
			// Request 1's state, its id changed to 2: the token no longer fits.
			forged = o1
			forged.RequestID = 2
			if err := pull(forged); !errors.Is(err, ErrRefused) {
				t.Fatalf("request 1's state naming request 2: %v, want ErrRefused", err)
			}
			// The genuine pulls, then a replay of one.
			for _, o := range []OpaqueState{o1, o2, ob} {
				if err := pull(o); err != nil {
					t.Fatalf("genuine pull of request %d: %v", o.RequestID, err)
				}
			}
			waitAll(t, append(append(r1, r2...), rb...), 10*time.Second)
			if err := pull(o1); !errors.Is(err, ErrRefused) {
				t.Fatalf("replay of request 1's state after it completed: %v, want ErrRefused", err)
			}
		})
	}
}

// TestGroupJoinSecret: a coordinated group takes the cluster secret of its
// Transceiver: processes with the same secret join (and the instance's
// signed states are pulled as usual); a process with another secret is
// refused, and neither side hangs past its ctx.
func TestGroupJoinSecret(t *testing.T) {
	cfg := testCfg()
	st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
	signed := newSplit(t, groupModes[0], st, cfg, 16, withSecret(testSecret, nil))
	gen := newInst(t, state(2, 4, 16, 8, kvcache.FP16, 1, 1, false), cfg, 16, withSecret(testSecret, nil))
	creqs, _ := signed.respond(t, 1, 16, 1)
	pullGenuine(t, gen, creqs[0])
	waitAll(t, creqs, 10*time.Second)

	other := bytes.Repeat([]byte("another-secret/"), 3)
	joinFails(t, st, cfg, "a mismatched secret", func(t *testing.T) [2]func(*Options) {
		return [2]func(*Options){withSecret(testSecret, nil), withSecret(other, nil)}
	})
}

// joinFails starts the two processes of a coordinated group of state st,
// the Options of each changed by what parties returns, and checks that
// neither joins: both New fail with their ctx's deadline, at that deadline
// (1s) exactly. It runs in a synctest bubble (network_test.go): the
// group's connections, like the ranks', are on an in-memory network;
// parties runs in the bubble, so that what it dates (certificates) is
// dated on the bubble's clock.
func joinFails(t *testing.T, st layout.CacheState, cfg *config.CacheTransceiver, why string, parties func(t *testing.T) [2]func(*Options)) {
	t.Helper()
	bubble(t, func(t *testing.T, nw *memNetwork) {
		ln, err := nw.Listen(t.Context(), "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		mods := parties(t)
		start := time.Now()
		trs, errs := formGroup(t, nw, ln, st, cfg, time.Second, mods)
		for _, tr := range trs {
			if tr != nil {
				tr.Close()
			}
		}
		ln.Close()
		for r, err := range errs {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("process %d with %s: %v, want the join to fail at its deadline", r, why, err)
			}
		}
		if d := time.Since(start); d != time.Second {
			t.Errorf("the refused join took %v, want its deadline, 1s", d)
		}
	})
}

// formGroup starts the two processes of a coordinated group of state st
// on nw (process 0 the coordinator, on ln), the Options of process r
// changed by mods[r] (nil: none), each New within timeout, and returns
// what each New returned. The pools are closed at the test's end.
func formGroup(t *testing.T, nw *memNetwork, ln net.Listener, st layout.CacheState, cfg *config.CacheTransceiver, timeout time.Duration, mods [2]func(*Options)) ([2]*Transceiver, [2]error) {
	t.Helper()
	var trs [2]*Transceiver
	var errs [2]error
	var wg sync.WaitGroup
	for r := range 2 {
		gc := CoordinatedConfig{Processes: 2, Coordinator: ln.Addr().String()}
		if r == 0 {
			gc.Listener = ln
		}
		g, err := NewCoordinatedGroup(gc)
		if err != nil {
			t.Fatal(err)
		}
		p, err := kvcache.NewPool(st.RankLayout(r), 2, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		opts := Options{State: st, Ranks: []int{r}, Pools: []*kvcache.Pool{p}, Group: g}
		if mods[r] != nil {
			mods[r](&opts)
		}
		withNetwork(nw)(&opts)
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			trs[r], errs[r] = New(ctx, cfg, opts)
		})
	}
	wg.Wait()
	return trs, errs
}

// TestGroupTLS: a coordinated group takes the Transceiver's mutual TLS:
// processes of one CA join and serve a pull over TLS; a process of another
// CA cannot join.
func TestGroupTLS(t *testing.T) {
	ca, err := tlsconf.NewAuthority("group test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	tc := tlsParty(t, ca, "context")
	st := state(2, 4, 16, 8, kvcache.BF16, 2, 1, false)
	ctxInst := newSplit(t, groupModes[0], st, testCfg(), 16, func(o *Options) { o.TLS = tc })
	gen := newInstTLS(t, state(2, 4, 16, 8, kvcache.BF16, 1, 1, false), testCfg(), 16, tlsParty(t, ca, "gen"), testLogger(t))
	creqs, _ := ctxInst.respond(t, 1, 40, 5)
	pullGenuine(t, gen, creqs[0])
	waitAll(t, creqs, 10*time.Second)
	for r, c := range creqs {
		if c.State() != DisaggContextComplete {
			t.Fatalf("rank %d: %s %v", r, c.State(), c.Err())
		}
	}

	// The join, with parties of two CAs made on the bubble's clock.
	joinFails(t, st, testCfg(), "the other of another CA", func(t *testing.T) [2]func(*Options) {
		ca, err := tlsconf.NewAuthority("group test CA", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		other, err := tlsconf.NewAuthority("another CA", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		tc, intruder := tlsParty(t, ca, "context"), tlsParty(t, other, "intruder")
		return [2]func(*Options){func(o *Options) { o.TLS = tc }, func(o *Options) { o.TLS = intruder }}
	})
}

// TestGatherGroupRounds: a GatherGroup's rounds as a C caller drives them:
// an empty contribution before its Transceiver starts; the join at the
// first round every process joins; a round that is not one (a wrong count,
// a contribution that does not decode) breaks the group on that process,
// and then its requests fail with ErrGroupLost and new ones are refused.
func TestGatherGroupRounds(t *testing.T) {
	cfg := testCfg()
	st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
	g0, g1 := NewGatherGroup(0, 2), NewGatherGroup(1, 2)
	if m, err := decodeGroupMsg(g1.Outbox()); err != nil || m.typ != groupMsgBatch || len(m.events) != 0 {
		t.Fatalf("Outbox before start: %+v %v, want an empty batch", m, err)
	}
	var trs []*Transceiver
	var pools []*kvcache.Pool
	for r, g := range []*GatherGroup{g0, g1} {
		p, err := kvcache.NewPool(st.RankLayout(r), 4, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, p)
		tr, err := New(context.Background(), cfg, Options{State: st, Ranks: []int{r}, Pools: []*kvcache.Pool{p}, Group: g})
		if err != nil {
			t.Fatal(err)
		}
		trs = append(trs, tr)
		defer p.Close()
		defer tr.Close()
	}
	b, err := pools[0].Allocate(1)
	if err != nil {
		t.Fatal(err)
	}
	defer pools[0].Release(b...)
	if err := trs[0].RespondAndSendAsync(&Request{ID: 1, Type: ContextOnly, Blocks: [][]kvcache.BlockID{b}}); !errors.Is(err, ErrNotJoined) {
		t.Fatalf("a request before the join: %v, want ErrNotJoined", err)
	}
	round := func() error {
		all := [][]byte{g0.Outbox(), g1.Outbox()}
		return errors.Join(g0.Deliver(all), g1.Deliver(all))
	}
	if err := round(); err != nil {
		t.Fatal(err)
	}
	for r, tr := range trs {
		select {
		case <-tr.Joined():
		default:
			t.Fatalf("process %d has not joined after a round of both joins", r)
		}
		if eps := tr.Endpoints(); len(eps) != 2 || eps[0] == "" || eps[1] == "" {
			t.Fatalf("process %d: endpoints %q", r, eps)
		}
	}
	req := &Request{ID: 1, Type: ContextOnly, Blocks: [][]kvcache.BlockID{b}}
	if err := trs[0].RespondAndSendAsync(req); err != nil {
		t.Fatal(err)
	}
	if err := g0.Deliver([][]byte{g0.Outbox()}); !errors.Is(err, ErrBadGroup) {
		t.Fatalf("a round of one contribution: %v, want ErrBadGroup", err)
	}
	waitDone(t, req, 5*time.Second)
	if !errors.Is(req.Err(), ErrGroupLost) {
		t.Fatalf("the request after the group broke: %s %v, want ErrGroupLost", req.State(), req.Err())
	}
	if err := trs[0].RespondAndSendAsync(&Request{ID: 2, Type: ContextOnly, Blocks: [][]kvcache.BlockID{b}}); !errors.Is(err, ErrGroupLost) {
		t.Fatalf("a request after the group broke: %v, want ErrGroupLost", err)
	}
	if err := g1.Deliver([][]byte{g1.Outbox(), {groupVersion, 99}}); !errors.Is(err, ErrBadGroupMessage) {
		t.Fatalf("a round with a contribution that does not decode: %v, want ErrBadGroupMessage", err)
	}
	if err := g1.Deliver([][]byte{g1.Outbox(), g1.Outbox()}); !errors.Is(err, ErrGroupLost) {
		t.Fatalf("a round after the group broke: %v, want ErrGroupLost", err)
	}
}

// TestHostileSilentJoiner: connections to the coordinator that say nothing
// (a stranger, a port scan) do not keep the group's processes waiting
// behind them: the group forms at once, not after each silent
// connection's WriteTimeout.
func TestHostileSilentJoiner(t *testing.T) {
	cfg := testCfg()
	st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
	bubble(t, func(t *testing.T, nw *memNetwork) {
		ln, err := nw.Listen(t.Context(), "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var silent []net.Conn
		for range 3 {
			c, err := nw.DialFrom(t.Context(), "127.0.0.9", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			silent = append(silent, c)
		}
		start := time.Now()
		trs, errs := formGroup(t, nw, ln, st, cfg, time.Minute, [2]func(*Options){})
		for r, err := range errs {
			if err != nil {
				t.Fatalf("process %d: %v", r, err)
			}
			defer trs[r].Close()
		}
		if d := time.Since(start); d > 0 {
			t.Errorf("the group formed after %v behind %d silent connections, want at once", d, len(silent))
		}
	})
}

// TestGatherGroupLostBeforeJoin: a gather group that breaks before its
// join (a round of the wrong number of contributions) says so to every
// later request, rather than that it has not joined yet.
func TestGatherGroupLostBeforeJoin(t *testing.T) {
	cfg := testCfg()
	st := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
	g := NewGatherGroup(0, 2)
	p, err := kvcache.NewPool(st.RankLayout(0), 4, PoolAllocator(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tr, err := New(context.Background(), cfg, Options{State: st, Ranks: []int{0}, Pools: []*kvcache.Pool{p}, Group: g})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if err := g.Deliver([][]byte{g.Outbox()}); !errors.Is(err, ErrBadGroup) {
		t.Fatalf("a round of 1 contribution for 2 processes: %v, want ErrBadGroup", err)
	}
	b, err := p.Allocate(1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release(b...)
	err = tr.RespondAndSendAsync(&Request{ID: 1, Type: ContextOnly, Blocks: [][]kvcache.BlockID{b}})
	if !errors.Is(err, ErrGroupLost) || errors.Is(err, ErrNotJoined) {
		t.Errorf("a request after the group broke before its join: %v, want ErrGroupLost", err)
	}
}
