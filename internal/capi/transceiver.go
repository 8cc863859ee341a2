package capi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"

	// The data planes a library's rank can use (UCX needs -tags ucx and
	// libucx at load time, which a library loaded into any engine cannot
	// assume: it is left out).
	_ "github.com/kvxfer/kvxfer/transport/shm"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

// PoolSpec is the memory of one hosted rank's pool.
type PoolSpec struct {
	// Memory is the caller's memory: kvxfer reads and writes it, never
	// frees it, and stops touching it when Close returns. At least
	// NumBlocks × the rank's block bytes long; nil asks kvxfer to allocate
	// a shareable (memfd) pool, which Close frees.
	Memory []byte
	// NumBlocks is the number of blocks of the pool.
	NumBlocks int
	// BlockBytes, when not 0, is the caller's idea of a block's size; it
	// must equal the rank's (a check that the caller's model description
	// matches its memory).
	BlockBytes int64
}

// Options are what Open needs beyond the config.
type Options struct {
	State StateDesc
	// Ranks are the ranks of the instance that this process hosts,
	// ascending, and Pools[i] is Ranks[i]'s pool. Empty means every rank.
	// When they are not every rank, Group says how this process agrees
	// with the processes hosting the others.
	Ranks []int
	Pools []PoolSpec
	Group GroupSpec
	// ListenHost is the address the ranks listen on; "" means 127.0.0.1.
	ListenHost string
	// Logger receives the transceiver's logs; nil discards them.
	Logger *slog.Logger
}

// GroupMode is how the processes of an instance agree on its requests.
type GroupMode int32

// Group modes (the values of the header's KVXFER_GROUP_*).
const (
	// GroupNone: this process hosts every rank of its instance.
	GroupNone GroupMode = 0
	// GroupCoordinated: over kvxfer's own connections, the process
	// hosting rank 0 coordinating (transceiver.CoordinatedGroup).
	GroupCoordinated GroupMode = 1
	// GroupGather: through an all-gather the caller runs, round by round
	// (Outbox, Deliver, Fail; transceiver.GatherGroup).
	GroupGather GroupMode = 2
)

// GroupSpec describes the group of an instance split over processes.
type GroupSpec struct {
	Mode GroupMode
	// Process is this process's index among Processes (GroupGather: its
	// place in the caller's all-gather).
	Process, Processes int
	// Coordinator (GroupCoordinated) is the host:port the process hosting
	// rank 0 listens on and the others dial.
	Coordinator string
}

// group builds the transceiver's Group of spec for config c.
func (spec GroupSpec) group(c *Config) (transceiver.Group, *transceiver.GatherGroup, error) {
	switch spec.Mode {
	case GroupNone:
		return nil, nil, nil
	case GroupCoordinated:
		g, err := transceiver.NewCoordinatedGroup(transceiver.CoordinatedConfig{Processes: spec.Processes, Coordinator: spec.Coordinator,
			Secret: c.secret, TLS: c.tls})
		if err != nil {
			return nil, nil, &Error{Code: CodeInvalidArgument, Err: fmt.Errorf("capi: group: %w", err)}
		}
		return g, nil, nil
	case GroupGather:
		if spec.Processes < 1 || spec.Process < 0 || spec.Process >= spec.Processes {
			return nil, nil, errorf(CodeInvalidArgument, "capi: group: process %d of %d processes", spec.Process, spec.Processes)
		}
		g := transceiver.NewGatherGroup(spec.Process, spec.Processes)
		return g, g, nil
	}
	return nil, nil, errorf(CodeInvalidArgument, "capi: group: unknown mode %d (0 none, 1 coordinated, 2 gather)", spec.Mode)
}

type side uint8

const (
	sideContext side = iota
	sideGen
)

func (s side) String() string {
	if s == sideContext {
		return "context"
	}
	return "generation"
}

// Finished is a request whose transfer ended, as a status call reports it.
type Finished struct {
	ID   uint64
	Code Code  // OK, or why it failed
	Err  error // nil when Code is OK
}

// maxFailedKept bounds the error messages of failed requests kept for
// RequestError, per side: the oldest are dropped first.
const maxFailedKept = 4096

// Transceiver is one process's part of an instance behind the C ABI: the
// transceiver of its hosted ranks, their pools, and the requests in flight
// by the caller's ids.
type Transceiver struct {
	tr     *transceiver.Transceiver
	state  layout.CacheState
	ranks  []int
	pools  []*kvcache.Pool
	shared []bool // pools[i] is kvxfer's (shareable), not the caller's
	gather *transceiver.GatherGroup
	// processes is the gather group's number of processes.
	processes int

	outMu  sync.Mutex
	outbox []byte // the gather group's contribution taken, not yet handed out
	outSet bool

	closeOnce sync.Once
	closeErr  error

	mu         sync.Mutex
	reqs       [2]map[uint64]*entry // in flight, by side and the caller's id
	done       [2][]Finished        // ended, not yet handed to the caller
	failed     [2]map[uint64]error  // why reported requests failed (RequestError)
	failedFIFO [2][]uint64
}

type entry struct {
	req    *transceiver.Request
	opaque []byte // context side: the opaque state handed out
	sync   bool   // a sync receive: its call reports it, not a status call
}

// Open builds the ranks o describes with the config c and starts them.
func Open(ctx context.Context, c *Config, o Options) (*Transceiver, error) {
	if c == nil {
		return nil, errorf(CodeInvalidArgument, "capi: open: no config")
	}
	st, err := o.State.CacheState()
	if err != nil {
		return nil, err
	}
	ranks := o.Ranks
	if len(ranks) == 0 {
		ranks = seq(st.Parallel.NumRanks())
	}
	for i, r := range ranks {
		if r < 0 || r >= st.Parallel.NumRanks() {
			return nil, errorf(CodeInvalidArgument, "capi: open: rank %d out of range [0,%d) of %s", r, st.Parallel.NumRanks(), st.Parallel)
		}
		if i > 0 && r <= ranks[i-1] {
			return nil, errorf(CodeInvalidArgument, "capi: open: ranks %v: not ascending without repeats (ranks[%d] is %d after %d)", ranks, i, r, ranks[i-1])
		}
	}
	if len(o.Pools) != len(ranks) {
		return nil, errorf(CodeInvalidArgument, "capi: open: %d pools for %d hosted ranks %v", len(o.Pools), len(ranks), ranks)
	}
	switch whole := len(ranks) == st.Parallel.NumRanks(); {
	case !whole && o.Group.Mode == GroupNone:
		return nil, errorf(CodeInvalidArgument, "capi: open: this process hosts ranks %v of the %d of %s: a group (coordinated or gather) is needed to agree with the processes hosting the others", ranks, st.Parallel.NumRanks(), st.Parallel)
	case whole && o.Group.Mode != GroupNone:
		return nil, errorf(CodeInvalidArgument, "capi: open: this process hosts every rank of %s: no group is needed (mode %d given)", st.Parallel, o.Group.Mode)
	}
	group, gather, err := o.Group.group(c)
	if err != nil {
		return nil, err
	}
	t := &Transceiver{state: st, ranks: slices.Clone(ranks),
		reqs:   [2]map[uint64]*entry{{}, {}},
		failed: [2]map[uint64]error{{}, {}}}
	for i, r := range ranks {
		p, shared, err := openPool(st.RankLayout(r), r, o.Pools[i])
		if err != nil {
			t.closePools()
			return nil, err
		}
		t.pools, t.shared = append(t.pools, p), append(t.shared, shared)
	}
	t.gather, t.processes = gather, o.Group.Processes
	t.tr, err = transceiver.New(ctx, c.ct, transceiver.Options{State: st, Ranks: t.ranks, Pools: t.pools, Group: group,
		ListenHost: o.ListenHost, Logger: o.Logger, Secret: c.secret, AllowedPeerHosts: c.allowed, TLS: c.tls})
	if err != nil {
		t.closePools()
		return nil, fmt.Errorf("capi: open: %w", err)
	}
	return t, nil
}

// errNoGather is returned by the gather calls of a transceiver without a
// gather group.
func (t *Transceiver) errNoGather(op string) error {
	return errorf(CodeInvalidArgument, "capi: %s: this transceiver's instance has no gather group (mode %d is gather)", op, GroupGather)
}

// Outbox returns this process's contribution to the next all-gather round
// of its gather group. It stays the same until HandedOut: a caller whose
// buffer was too small asks again without losing it.
func (t *Transceiver) Outbox() ([]byte, error) {
	if t.gather == nil {
		return nil, t.errNoGather("group outbox")
	}
	t.outMu.Lock()
	defer t.outMu.Unlock()
	if !t.outSet {
		t.outbox, t.outSet = t.gather.Outbox(), true
	}
	return t.outbox, nil
}

// HandedOut says that the caller has the contribution Outbox returned: the
// next Outbox takes a new one.
func (t *Transceiver) HandedOut() {
	t.outMu.Lock()
	t.outbox, t.outSet = nil, false
	t.outMu.Unlock()
}

// Deliver applies a round of the gather group: every process's
// contribution, in process order. Its errors are CodeGroup: a round that
// is not one (a contribution that does not decode, a join that does not
// make the instance) breaks the group on this process, and a broken group
// is the header's KVXFER_ERR_GROUP ("lost, or bad"), not a peer's. A
// number of contributions other than the group's processes is the
// caller's mistake (its n), refused before the group sees it, which would
// break on it: the caller may deliver the round again.
func (t *Transceiver) Deliver(all [][]byte) error {
	if t.gather == nil {
		return t.errNoGather("group deliver")
	}
	if len(all) != t.processes {
		return errorf(CodeInvalidArgument, "capi: group deliver: %d contributions, the group has %d processes (one each, in process order)", len(all), t.processes)
	}
	if err := t.gather.Deliver(all); err != nil {
		return &Error{Code: CodeGroup, Err: fmt.Errorf("capi: group deliver: %w", err)}
	}
	return nil
}

// Fail breaks the gather group on this process (a round failed): the
// requests in flight fail, new ones are refused.
func (t *Transceiver) Fail(why string) error {
	if t.gather == nil {
		return t.errNoGather("group fail")
	}
	t.gather.Fail(fmt.Errorf("capi: the caller failed the group: %s", why))
	return nil
}

func seq(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// openPool makes rank's pool from spec and pins every block (see the
// package docs, Pools).
func openPool(bl kvcache.BlockLayout, rank int, spec PoolSpec) (*kvcache.Pool, bool, error) {
	bb := bl.BlockBytes()
	if spec.BlockBytes != 0 && spec.BlockBytes != bb {
		return nil, false, errorf(CodeInvalidArgument, "capi: pool of rank %d: block_bytes %d, but the cache state gives this rank blocks of %d bytes (%+v)", rank, spec.BlockBytes, bb, bl)
	}
	if spec.NumBlocks <= 0 || spec.NumBlocks > kvcache.MaxBlocks {
		return nil, false, errorf(CodeInvalidArgument, "capi: pool of rank %d: %d blocks, want 1..%d", rank, spec.NumBlocks, kvcache.MaxBlocks)
	}
	var alloc kvcache.Allocator = kvcache.ShmAllocator{Name: fmt.Sprintf("kvxfer-rank%d", rank)}
	if spec.Memory != nil {
		need := bb * int64(spec.NumBlocks)
		if int64(len(spec.Memory)) < need {
			return nil, false, errorf(CodeInvalidArgument, "capi: pool of rank %d: %d bytes of memory for %d blocks of %d bytes (%d needed)", rank, len(spec.Memory), spec.NumBlocks, bb, need)
		}
		alloc = callerMemory{b: spec.Memory[:need:need]}
	}
	p, err := kvcache.NewPool(bl, spec.NumBlocks, alloc)
	if err != nil {
		return nil, false, &Error{Code: CodeInvalidArgument, Err: fmt.Errorf("capi: pool of rank %d: %w", rank, err)}
	}
	if _, err := p.Allocate(spec.NumBlocks); err != nil {
		p.Close()
		return nil, false, &Error{Code: CodeInternal, Err: fmt.Errorf("capi: pool of rank %d: pin every block: %w", rank, err)}
	}
	return p, spec.Memory == nil, nil
}

// callerMemory is an Allocator over memory the caller owns: its one arena
// is that memory, which Close leaves alone. Unlike the kvcache allocators
// it does not zero the memory: it is the caller's cache.
type callerMemory struct{ b []byte }

func (m callerMemory) Allocate(size int) (kvcache.Arena, error) {
	if size != len(m.b) {
		return nil, fmt.Errorf("capi: caller memory of %d bytes asked for %d", len(m.b), size)
	}
	return &callerArena{b: m.b}, nil
}

type callerArena struct {
	mu sync.Mutex
	b  []byte // nil once closed
}

func (a *callerArena) Bytes() []byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.b
}

func (a *callerArena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.b = nil
	return nil
}

func (t *Transceiver) closePools() {
	for _, p := range t.pools {
		p.Close()
	}
}

// Ranks returns the hosted ranks.
func (t *Transceiver) Ranks() []int { return slices.Clone(t.ranks) }

// State returns the instance's cache state.
func (t *Transceiver) State() layout.CacheState { return t.state }

// PoolMemory returns the memory of hosted rank i's pool (index in Ranks),
// the caller's or kvxfer's; nil after Close.
func (t *Transceiver) PoolMemory(i int) []byte {
	if i < 0 || i >= len(t.pools) {
		return nil
	}
	return t.pools[i].Arena().Bytes()
}

// Endpoints returns the control endpoints of the hosted ranks.
func (t *Transceiver) Endpoints() []string { return t.tr.Endpoints() }

// checkRequest checks a request's own arguments against the instance: its
// DP rank, its prompt length (0: unknown), and the caller's block ids
// (blocks[i] for hosted rank i: in range, none twice), which it returns as
// the transceiver's Request.Blocks. On the context side every hosted rank of the request's
// DP group gives the same number of blocks, not none. They are checked
// here, before the transceiver, so that they are the caller's
// CodeInvalidArgument, and so that a receive refused for one of them has
// not spent its opaque state (the transceiver records a signed state's
// nonce before it looks at them).
func (t *Transceiver) checkRequest(op string, id uint64, dpRank, tokens int, blocks [][]kvcache.BlockID) ([][]kvcache.BlockID, error) {
	pc := t.state.Parallel
	switch {
	case !pc.AttentionDP && dpRank != 0:
		return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: dp_rank %d, but the instance has no attention DP (want 0)", op, id, dpRank)
	case pc.AttentionDP && (dpRank < 0 || dpRank >= pc.DPSize):
		return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: dp_rank %d out of range [0,%d)", op, id, dpRank, pc.DPSize)
	case tokens < 0:
		return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: num_tokens %d (want the prompt's length, or 0: unknown)", op, id, tokens)
	}
	if len(blocks) != len(t.ranks) {
		return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: block ids for %d ranks, this process hosts %d", op, id, len(blocks), len(t.ranks))
	}
	out := make([][]kvcache.BlockID, len(t.ranks))
	first := -1 // the first hosted rank of the request's DP group
	for i, r := range t.ranks {
		seen := make(map[kvcache.BlockID]struct{}, len(blocks[i]))
		for _, b := range blocks[i] {
			if b < 0 || int(b) >= t.pools[i].NumBlocks() {
				return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: block %d of rank %d is out of range [0,%d)", op, id, b, r, t.pools[i].NumBlocks())
			}
			if _, dup := seen[b]; dup {
				// A receive would write two of the context's blocks into it.
				return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: block %d of rank %d is listed twice", op, id, b, r)
			}
			seen[b] = struct{}{}
		}
		out[i] = slices.Clone(blocks[i])
		if op != "respond" || !t.inDPGroup(r, dpRank) {
			continue
		}
		switch {
		case len(blocks[i]) == 0:
			return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: no blocks for rank %d, which holds part of DP group %d", op, id, r, dpRank)
		case first < 0:
			first = i
		case len(blocks[i]) != len(blocks[first]):
			return nil, errorf(CodeInvalidArgument, "capi: %s: request %d: %d blocks for rank %d, %d for rank %d (the ranks of a request hold as many)",
				op, id, len(blocks[i]), r, len(blocks[first]), t.ranks[first])
		}
	}
	return out, nil
}

// inDPGroup reports whether rank holds part of the requests of DP group dp
// (every rank does without attention DP).
func (t *Transceiver) inDPGroup(rank, dp int) bool {
	pc := t.state.Parallel
	if !pc.AttentionDP {
		return true
	}
	_, _, tp := pc.Coords(rank)
	g, _ := pc.DPGroup(tp)
	return g == dp
}

// reserve records a new request of side s under the caller's id.
func (t *Transceiver) reserve(s side, id uint64, e *entry) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, dup := t.reqs[s][id]; dup {
		return fmt.Errorf("%w: %s request %d is already in flight", ErrInFlight, s, id)
	}
	t.reqs[s][id] = e
	return nil
}

func (t *Transceiver) unreserve(s side, id uint64) {
	t.mu.Lock()
	delete(t.reqs[s], id)
	t.mu.Unlock()
}

// RespondAndSend hands context request id, whose prefill fills blocks
// (blocks[i] for hosted rank i; ranks outside the request's DP group give
// none), to the transceiver and returns its opaque state, which the
// generation side needs to pull it. tokens is the prompt's length (0:
// unknown, not checked by the generation side).
func (t *Transceiver) RespondAndSend(id uint64, dpRank, tokens int, blocks [][]kvcache.BlockID) ([]byte, error) {
	bs, err := t.checkRequest("respond", id, dpRank, tokens, blocks)
	if err != nil {
		return nil, err
	}
	e := &entry{req: &transceiver.Request{ID: id, Type: transceiver.ContextOnly, DPRank: dpRank, Blocks: bs, NumTokens: tokens}}
	if err := t.reserve(sideContext, id, e); err != nil {
		return nil, err
	}
	if err := t.tr.RespondAndSendAsync(e.req); err != nil {
		t.unreserve(sideContext, id)
		return nil, fmt.Errorf("capi: respond: %w", err)
	}
	t.mu.Lock()
	e.opaque = e.req.ContextPhase.OpaqueState
	t.mu.Unlock()
	return e.opaque, nil
}

// OpaqueState returns the opaque state of context request id, while it is
// in flight or finished and not yet reported.
func (t *Transceiver) OpaqueState(id uint64) ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e, ok := t.reqs[sideContext][id]; ok && e.opaque != nil {
		return e.opaque, nil
	}
	return nil, fmt.Errorf("%w: no context request %d in flight", ErrNotFound, id)
}

// RequestAndReceive starts pulling the context request that opaque names
// into blocks (blocks[i] for hosted rank i), as generation request id.
func (t *Transceiver) RequestAndReceive(id uint64, dpRank, tokens int, opaque []byte, blocks [][]kvcache.BlockID) error {
	return t.receive(false, context.Background(), id, dpRank, tokens, opaque, blocks)
}

// RequestAndReceiveSync is RequestAndReceive followed by a wait for the
// transfer's end, bounded by ctx: when ctx ends first the transfer is
// cancelled and the error's code is CodeTimeout. The request is not
// reported by a status call.
func (t *Transceiver) RequestAndReceiveSync(ctx context.Context, id uint64, dpRank, tokens int, opaque []byte, blocks [][]kvcache.BlockID) error {
	return t.receive(true, ctx, id, dpRank, tokens, opaque, blocks)
}

// receive is RequestAndReceiveSync when sync, else RequestAndReceive (and
// ctx is unused).
func (t *Transceiver) receive(sync bool, ctx context.Context, id uint64, dpRank, tokens int, opaque []byte, blocks [][]kvcache.BlockID) error {
	if len(opaque) == 0 {
		return errorf(CodeBadOpaqueState, "capi: receive: request %d: empty opaque state", id)
	}
	bs, err := t.checkRequest("receive", id, dpRank, tokens, blocks)
	if err != nil {
		return err
	}
	req := &transceiver.Request{ID: id, Type: transceiver.GenerationOnly, DPRank: dpRank, Blocks: bs, NumTokens: tokens,
		ContextPhase: &transceiver.ContextPhaseParams{OpaqueState: slices.Clone(opaque)}}
	if err := t.reserve(sideGen, id, &entry{req: req, sync: sync}); err != nil {
		return err
	}
	if !sync {
		if err := t.tr.RequestAndReceiveAsync(req); err != nil {
			t.unreserve(sideGen, id)
			return fmt.Errorf("capi: receive: %w", err)
		}
		return nil
	}
	err = t.tr.RequestAndReceiveSync(ctx, req)
	t.unreserve(sideGen, id)
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil && errors.Is(err, transceiver.ErrCanceled):
		return &Error{Code: CodeTimeout, Err: fmt.Errorf("capi: receive: request %d did not end in time and was cancelled: %w", id, context.Cause(ctx))}
	}
	return fmt.Errorf("capi: receive: %w", err)
}

// CheckContextStatus returns the context requests whose transfers ended,
// at most room of them (the others wait for the next call). It first waits,
// bounded by ctx, until at least atLeast have ended or none is in flight
// (atLeast 0: no wait; below 0: every request in flight). When ctx ends
// first it returns what has ended with ctx's error.
func (t *Transceiver) CheckContextStatus(ctx context.Context, atLeast, max int) ([]Finished, error) {
	return t.check(ctx, sideContext, atLeast, max)
}

// CheckGenStatus is CheckContextStatus for the generation side.
func (t *Transceiver) CheckGenStatus(ctx context.Context, atLeast, max int) ([]Finished, error) {
	return t.check(ctx, sideGen, atLeast, max)
}

func (t *Transceiver) check(ctx context.Context, s side, atLeast, room int) ([]Finished, error) {
	if room < 0 {
		return nil, errorf(CodeInvalidArgument, "capi: check %s status: room for %d ids", s, room)
	}
	t.mu.Lock()
	queued := len(t.done[s])
	t.mu.Unlock()
	need := -1
	if atLeast >= 0 {
		need = max(0, atLeast-queued)
	}
	check := t.tr.CheckContextTransferStatus
	if s == sideGen {
		check = t.tr.CheckGenTransferStatus
	}
	got, werr := check(ctx, need)
	if werr != nil {
		// Nothing was taken; collect what has ended without waiting.
		got, _ = check(context.Background(), 0)
		werr = fmt.Errorf("capi: check %s status: waiting for at least %d finished requests: %w", s, atLeast, werr)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range got {
		e, ok := t.reqs[s][r.ID]
		if !ok || e.req != r || e.sync {
			continue // a sync receive's, reported by its own call
		}
		delete(t.reqs[s], r.ID)
		f := Finished{ID: r.ID, Code: CodeOf(r.Err())}
		if err := r.Err(); err != nil {
			f.Err = fmt.Errorf("capi: %s request %d: %w", s, r.ID, err)
			if f.Code == OK {
				f.Code = CodeTransfer
			}
			t.keepFailedLocked(s, r.ID, f.Err)
		}
		t.done[s] = append(t.done[s], f)
	}
	n := min(room, len(t.done[s]))
	out := slices.Clone(t.done[s][:n])
	t.done[s] = slices.Delete(t.done[s], 0, n)
	return out, werr
}

func (t *Transceiver) keepFailedLocked(s side, id uint64, err error) {
	if _, ok := t.failed[s][id]; !ok {
		t.failedFIFO[s] = append(t.failedFIFO[s], id)
	}
	t.failed[s][id] = err
	for len(t.failedFIFO[s]) > maxFailedKept {
		delete(t.failed[s], t.failedFIFO[s][0])
		t.failedFIFO[s] = t.failedFIFO[s][1:]
	}
}

// RequestError returns why a request that a status call reported as
// failed failed, on the context side (gen false) or the generation side;
// the last maxFailedKept failures of each side are kept.
func (t *Transceiver) RequestError(gen bool, id uint64) error {
	s := sideContext
	if gen {
		s = sideGen
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err, ok := t.failed[s][id]; ok {
		return err
	}
	return fmt.Errorf("%w: no failed %s request %d was reported (or it was among the oldest dropped)", ErrNotFound, s, id)
}

// GenTransferComplete reports whether no generation transfer is in flight.
func (t *Transceiver) GenTransferComplete() bool { return t.tr.GenTransferComplete() }

// Cancel cancels request id on whichever side it is in flight. It reports
// whether a transfer was cancelled; the request is then reported failed
// with CodeCanceled.
func (t *Transceiver) Cancel(id uint64) bool {
	t.mu.Lock()
	var reqs []*transceiver.Request
	for s := range t.reqs {
		if e, ok := t.reqs[s][id]; ok {
			reqs = append(reqs, e.req)
		}
	}
	t.mu.Unlock()
	any := false
	for _, r := range reqs {
		if t.tr.Cancel(r) {
			any = true
		}
	}
	return any
}

// Close fails every transfer in flight, stops the ranks and frees the
// pools kvxfer allocated; the caller's memory is no longer touched once it
// returns. Idempotent.
func (t *Transceiver) Close() error {
	t.closeOnce.Do(func() {
		t.closeErr = t.tr.Close()
		t.closePools()
	})
	return t.closeErr
}
