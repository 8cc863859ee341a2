package transceiver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transceiver/internal/link"
	"github.com/kvxfer/kvxfer/transceiver/internal/mover"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transceiver/internal/workers"
	"github.com/kvxfer/kvxfer/transport"
)

// The driver: one rank's goroutines around the protocol cores (see "Pure
// cores, one driver" in doc.go); the data mover's side is in mover.go.

// rankDone is how a rank reports that its part of a request ended.
type rankDone func(rank int, key instKey, err error, res rankResult)

// begunFunc tells a rank whether the instance's consensus shows context
// request id begun on another rank, not over and not yet reported by this
// one, and since when (see askHold). nil: never (every rank of the
// instance is in this process, and all are handed a request at once).
type begunFunc func(id uint64, rank int) (time.Time, bool)

// attemptEnd is how a rank reports that its part of a pull attempt of a
// context request ended: its sends finished (err nil) or the attempt
// failed. The instance's word comes back with rank.decide.
type attemptEnd func(rank int, key instKey, attempt uint64, err error)

// rank is one rank's transceiver: a control listener, the data planes, the
// staging buffers and the requests in flight.
//
// Lock order: rank.mu, then the control plane's (Plane.Conn, Conn.Touch),
// then the runtime's timers (arming and stopping a deadline); rank.mu,
// then the Transceiver's (begunFunc). Conn.Send is
// never called under rank.mu: effects run after the lock is released.
type rank struct {
	idx        int
	pool       *kvcache.Pool
	set        rankSettings
	transports map[string]transport.Transport
	names      []string       // of the transports, sorted
	ctrl       *control.Plane // the control connections
	links      *link.Linker   // the context ranks reached over ctrl
	sendBufs   *mover.Buffers
	recvBufs   *mover.Buffers
	done       rankDone
	attempt    attemptEnd
	begun      begunFunc // nil: asks are never held
	log        *slog.Logger
	refusals   *netlimit.RateLog // the log of refused request-infos (logRefusal)

	// goes runs every goroutine of this rank: sends, receives, dials.
	goes *workers.Pool
	obs  Observer   // nil: none
	csv  *timingCSV // nil: none

	mu     sync.Mutex
	closed bool
	// reqs are the requests in flight and, under the key sideHold, the
	// ask hold: asks for context requests not handed to this rank yet
	// (hold, its core).
	reqs map[reqKey]*rankReq
	hold *askHold
	// deadlines are the deadline ticks of reqs, behind one timer.
	deadlines deadlines
}

// reqKey names a request on a rank: send side by the context request's id,
// receive side by the rank's own id of the transfer (what the peer's
// frames carry).
type reqKey struct {
	side side
	id   uint64
}

// rankReq is one request in flight on a rank, on either side: its core, and
// what carrying out the core's effects needs.
type rankReq struct {
	key       reqKey
	reqID     uint64 // the instance's Request.ID
	core      protocolCore
	mem       [][]byte
	blocks    []kvcache.BlockID // send side: the references held
	endpoints []string          // receive side: the context ranks' control endpoints
	ctx       context.Context   // ends when the request stops: bounds its sends and receives
	cancel    context.CancelCauseFunc
	stats     rankStats
	// workers counts the goroutines (and the steps whose effects are
	// being carried out) that may still touch mem: the blocks go back only
	// after they end.
	workers workers.Group

	// Guarded by rank.mu.
	over bool      // the core completed: later events are dropped
	due  tickEntry // the deadline tick the core asked for

	attempts *mover.Attempts // send side: the pull attempts' sends
	// srcs are the receive side's sources, by context rank. Each is
	// written by its one ask before the core hears of it (evDialled), its
	// direct receipt by the request-info's effect before the receive
	// starts; read after that, or once workers have ended, so unlocked.
	srcs []srcIO
}

// srcIO is the data-plane state of one source of a receive.
type srcIO struct {
	conn   *control.Conn
	tr     transport.Transport
	direct transport.Recv // receipt armed for a direct transfer; nil: none
}

// stagingHold is the hold limit of the rank's staging buffers.
func (set rankSettings) stagingHold() mover.HoldLimit {
	return mover.HoldLimit{Base: max(set.limits.StagingHold, 0), Rate: StagingHoldRate, Err: ErrStalled}
}

func newRank(idx int, state layout.CacheState, pool *kvcache.Pool, set rankSettings, trs map[string]transport.Transport, ln net.Listener, done rankDone, attempt attemptEnd) *rank {
	bb := min(max(set.bufferBytes, pool.BlockBytes()), 1<<40)
	r := &rank{
		idx: idx, pool: pool, set: set, transports: trs, done: done, attempt: attempt,
		goes:     workers.NewPool(maxIdleWorkers),
		names:    slices.Sorted(maps.Keys(trs)),
		sendBufs: mover.NewBuffers(set.sendBuffers, int(bb), set.stagingHold(), stagingAlloc),
		recvBufs: mover.NewBuffers(set.recvBuffers, int(bb), set.stagingHold(), stagingAlloc),
		log:      set.logger.With("rank", idx),
		hold:     newAskHold(idx, set.timeout),
	}
	r.refusals = netlimit.NewRateLog(r.log, time.Second)
	held := r.newReq(reqKey{side: sideHold}, 0, nil)
	held.core = r.hold
	r.reqs = map[reqKey]*rankReq{held.key: held}
	r.deadlines.fire = r.tick
	st, _ := state.MarshalBinary()
	cc := set.control // with this rank's listener, name, log and hello
	cc.Listener, cc.Name, cc.Log, cc.AcceptOK = ln, fmt.Sprintf("control rank %d", idx), r.log, set.peers.accepter(r.log)
	cc.Hello = link.Hello(uint32(idx), st, set.host, trs)
	r.ctrl = control.New(cc, r)
	r.links = link.New(link.Config{Plane: r.ctrl, Want: set.backend, Auto: autoOrder(), Transports: trs, Host: set.host, Log: r.log})
	return r
}

// respond holds a context request: its blocks are retained until the
// transfer ends or the deadline passes.
func (r *rank) respond(id uint64, token [16]byte, state layout.CacheState, blocks []kvcache.BlockID, hashes []kvcache.Hash, digest kvcache.Hash) error {
	if err := r.pool.Retain(blocks...); err != nil {
		return fmt.Errorf("transceiver: rank %d: hold blocks of request %d: %w", r.idx, id, err)
	}
	mem, err := r.pool.Blocks(blocks)
	if err != nil {
		r.pool.Release(blocks...)
		return fmt.Errorf("transceiver: rank %d: request %d: %w", r.idx, id, err)
	}
	q := r.newReq(reqKey{sideSend, id}, id, mem)
	q.blocks, q.attempts = slices.Clone(blocks), mover.NewAttempts(q.ctx)
	q.core = newSendCore(sendConfig{rank: r.idx, id: id, token: token, state: state, blocks: len(blocks), hashes: hashes, digest: digest,
		backends: r.names, bufBytes: int64(r.sendBufs.Size()), timeout: r.set.timeout, senderTimeout: r.set.senderTimeout, plans: r.set.plans})
	if err := r.admit(q); err != nil {
		r.pool.Release(blocks...)
		return err
	}
	return nil
}

// receive starts pulling context request op into blocks (this rank's, in
// request order). id is the pull's id (wire GenRequestID), the same on
// every rank of the instance; self is the instance's state with the DP rank
// of this request.
func (r *rank) receive(id, reqID uint64, op *OpaqueState, self layout.CacheState, blocks []kvcache.BlockID, lastHash *kvcache.Hash, digest kvcache.Hash) error {
	core, err := newRecvCore(recvConfig{rank: r.idx, id: id, reqID: reqID, sendID: op.RequestID, token: op.Token,
		sender: op.State, self: self, peers: len(op.Endpoints), blocks: len(blocks), lastHash: lastHash, digest: digest,
		bufBytes: int64(r.recvBufs.Size()), direct: r.set.direct, timeout: r.set.timeout, plans: r.set.plans})
	if err != nil {
		return err
	}
	mem, err := r.pool.Blocks(blocks)
	if err != nil {
		return fmt.Errorf("transceiver: rank %d: request %d: %w", r.idx, reqID, err)
	}
	q := r.newReq(reqKey{sideRecv, id}, reqID, mem)
	q.core, q.endpoints, q.srcs = core, op.Endpoints, make([]srcIO, len(op.Endpoints))
	return r.admit(q)
}

func (r *rank) newReq(key reqKey, reqID uint64, mem [][]byte) *rankReq {
	ctx, cancel := context.WithCancelCause(context.Background())
	q := &rankReq{key: key, reqID: reqID, mem: mem, ctx: ctx, cancel: cancel, stats: rankStats{start: r.set.now()}}
	q.due = newTickEntry(q)
	return q
}

// admit registers q and starts its core.
func (r *rank) admit(q *rankReq) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		q.cancel(ErrClosed)
		return ErrClosed
	}
	if _, dup := r.reqs[q.key]; dup {
		r.mu.Unlock()
		q.cancel(nil)
		return invalidRequest("transceiver: rank %d: context request %d is already in flight", r.idx, q.key.id)
	}
	r.reqs[q.key] = q
	if r.obs != nil {
		r.obs.TransferStarted(roleOf(q.key.side))
	}
	now := time.Now()
	evs := []event{evStart{now: now}}
	if q.key.side == sideSend {
		// Asks that came before this rank was handed the request, but
		// those whose connection has left the plane: its Lost may have
		// looked for the connection's users before this request had any.
		for _, e := range r.hold.step(evHandedOver{id: q.key.id}) {
			if h, ok := e.(effTakeAsk); ok && r.ctrl.Conn(uint64(h.from.conn)) != nil {
				evs = append(evs, evAsk{from: h.from, ri: h.ri, now: now})
			}
		}
	}
	effs, _ := r.stepLocked(q, evs...)
	r.mu.Unlock()
	r.run(q, effs)
	return nil
}

// feed runs ev on the request find returns, under the lock, and carries
// out the effects after; when there is no such request, it feeds the ask
// hold held instead (nil: nothing), under the same lock, so that a request
// handed over meanwhile takes what the hold keeps; an early ask learns
// there whether the instance has begun its request on another rank
// (begunFunc). It reports how many effects ev had on the request (0 when
// the hold took held).
func (r *rank) feed(find func() *rankReq, ev, held event) int {
	r.mu.Lock()
	q := find()
	if q == nil && held != nil && !r.closed {
		if a, ok := held.(evEarlyAsk); ok && r.begun != nil {
			a.begunAt, a.begun = r.begun(a.ri.CtxRequestID, r.idx)
			held = a
		}
		q, ev = r.reqs[reqKey{side: sideHold}], held
	}
	var effs []effect
	live := q != nil
	if live {
		effs, live = r.stepLocked(q, ev)
	}
	r.mu.Unlock()
	if !live {
		return 0
	}
	r.run(q, effs)
	if q.key.side == sideHold {
		return 0
	}
	return len(effs)
}

// step feeds ev to q.
func (r *rank) step(q *rankReq, ev event) { r.feed(func() *rankReq { return q }, ev, nil) }

// pulling reports whether context request id has a pull attempt in
// progress on this rank (an ask accepted, not failed, not over) that has
// not gone on for longer than the staging hold limit of its bytes.
func (r *rank) pulling(id uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	q := r.reqs[reqKey{sideSend, id}]
	if q == nil || q.over {
		return false
	}
	c, ok := q.core.(*sendCore)
	if !ok || c.attempt == 0 {
		return false
	}
	var n int64
	for _, b := range q.mem {
		n += int64(len(b))
	}
	return time.Since(c.attemptAt) < r.set.stagingHold().For(n)
}

// stepLocked runs evs, in order, on q's core. Unless q is over, the
// caller must pass the effects to run, which ends the hold taken here on
// q's blocks.
func (r *rank) stepLocked(q *rankReq, evs ...event) ([]effect, bool) {
	if q.over {
		return nil, false
	}
	var effs []effect
	if len(evs) == 1 {
		effs = q.core.step(evs[0])
	} else {
		for _, ev := range evs {
			effs = append(effs, q.core.step(ev)...)
		}
	}
	if q.core.state().over() {
		q.over = true
		delete(r.reqs, q.key)
		r.deadlines.remove(&q.due)
		for _, id := range q.core.conns() {
			if cc := r.ctrl.Conn(uint64(id)); cc != nil {
				cc.Touch() // idle from now on, if nothing else uses it
			}
		}
	}
	q.workers.Add(1)
	return effs, true
}

// run carries out effects of q's core.
func (r *rank) run(q *rankReq, effs []effect) {
	defer q.workers.Done()
	release := false
	for _, e := range effs {
		switch e := e.(type) {
		case effArmTimer:
			// A core has one deadline tick: the one armed last. (The
			// hold outlives close, which stops the timer.)
			r.mu.Lock()
			if !q.over && !r.closed {
				r.deadlines.arm(&q.due, e.at)
			}
			r.mu.Unlock()
		case effRefuse:
			r.logRefusal(e)
		case effStartSend:
			ctx, descs := q.attempts.Start(e.attempt, e.gen, e.pair.direct == nil)
			r.work(q, func() (mover.Moved, event) { return r.sendPair(ctx, q, e, descs) })
		case effChunk:
			if !q.attempts.Announce(e.attempt, e.gen, mover.Chunk{Index: e.index, Desc: e.desc}) {
				r.step(q, evDescOverflow{gen: e.gen, attempt: e.attempt})
			}
		case effStopAttempt:
			q.attempts.Stop(e.attempt, fmt.Errorf("%w: pull attempt %d of request %d given up", ErrCanceled, e.attempt, q.reqID))
		case effAttemptEnded:
			if e.err != nil {
				r.log.Info("pull attempt failed; the context request stays pullable", "request", q.reqID, "attempt", e.attempt, "err", e.err)
			} else if r.log.Enabled(context.Background(), slog.LevelDebug) {
				r.log.Debug("pull attempt sent", "request", q.reqID, "attempt", e.attempt)
			}
			r.attempt(r.idx, instKey{q.key.side, q.reqID}, e.attempt, e.err)
		case effAsk:
			// On this goroutine when the connection is up already (the
			// request-info is then one write away); a dial, or a probe of
			// the peer's shm endpoint, on a worker.
			q.workers.Add(1)
			r.links.Reach(q.ctx, q.endpoints[e.src], r.goes.Go, func(l link.Link, err error) {
				defer q.workers.Done()
				r.linked(q, e.src, l, err)
			})
		case effRequestInfo:
			if err := r.requestInfo(q, e); err != nil {
				r.step(q, evAskFailed{src: e.src, err: err})
				break
			}
			if e.direct {
				r.work(q, func() (mover.Moved, event) { return r.recvDirect(q, e) })
			}
		case effStartRecv:
			r.work(q, func() (mover.Moved, event) { return r.recvPair(q, e) })
		case effStopAll:
			q.cancel(ErrCanceled)
		case effRelease:
			release = true
		case effComplete:
			r.finish(q, e.err, release)
		}
		if rp, ok := e.(reply); ok {
			r.send(rp.dest(), rp.frame())
		}
	}
}

// logRefusal logs a refused request-info, at most one line a second per
// refusal code (and per whether the core noted why, say a wrong token),
// with the count of those left out: anyone who completes a hello can
// write asks as fast as the connection takes them, each refused, and must
// not buy a log line with every frame.
func (r *rank) logRefusal(e effRefuse) {
	from := ""
	if cc := r.ctrl.Conn(uint64(e.to.conn)); cc != nil {
		from = cc.Peer().Endpoint
	}
	key := "refused request-info: " + refusalCodes[e.code]
	args := []any{"request", e.to.sendID, "gen_rank", e.gen, "from", from, "code", refusalCodes[e.code], "reason", e.reason}
	if e.note != "" {
		key += ", noted"
		args = append(args, "note", e.note)
	}
	r.refusals.Warn(key, "refused request-info", args...)
}

// tick feeds a deadline tick to each core whose deadline has come: the
// requests' and the ask hold's.
func (r *rank) tick() {
	now := time.Now()
	r.mu.Lock()
	due := r.deadlines.due(now)
	r.mu.Unlock()
	for _, d := range due {
		r.step(d.q, evTick{now: now})
	}
}

// send writes a frame on the connection of a route; one that is gone (or
// was never dialled) gets nothing: its own failure is already reported.
func (r *rank) send(to route, f wire.Frame) {
	if cc := r.ctrl.Conn(uint64(to.conn)); cc != nil {
		cc.Send(f)
	}
}

// work runs a send or a receive of q (move: what it moved, and the event
// that tells the core it ended) on a worker goroutine, accounts its
// figures and feeds the core its end.
func (r *rank) work(q *rankReq, move func() (mover.Moved, event)) {
	r.mu.Lock()
	if q.stats.moving.IsZero() {
		q.stats.moving = r.set.now()
	}
	r.mu.Unlock()
	q.workers.Add(1)
	r.goes.Go(func() {
		defer q.workers.Done() // after the step: the completion reads the stats
		m, end := move()
		r.mu.Lock()
		q.stats.add(m)
		r.mu.Unlock()
		r.step(q, end)
	})
}

// maxIdleWorkers bounds the worker goroutines a rank keeps waiting for
// work (see workers.Pool).
const maxIdleWorkers = 16

// linked hands the core the outcome of reaching context rank src for q
// (effAsk); the core then writes the request-info.
func (r *rank) linked(q *rankReq, src int, l link.Link, err error) {
	if err != nil {
		r.step(q, evAskFailed{src: src, err: err})
		return
	}
	defer l.Release()
	q.srcs[src] = srcIO{conn: l.Conn, tr: l.Transport}
	r.step(q, evDialled{src: src, conn: connID(l.Conn.ID()), backend: l.Backend})
}

// requestInfo sends the request-info, first arming the receipt of a direct
// transfer straight into the blocks when the core asks for one.
func (r *rank) requestInfo(q *rankReq, e effRequestInfo) error {
	s := &q.srcs[e.src]
	if e.direct {
		rv, err := mover.Pair{Transport: s.tr, Blocks: q.mem, Plan: e.plan}.ExpectDirect()
		if err != nil {
			return err
		}
		s.direct, e.ri.Desc = rv, rv.Descriptor()
	}
	return s.conn.Send(&e.ri)
}

// finish ends q on this rank once nothing touches its blocks any more:
// blocks back (release), figures reported, the instance told. It is
// called by run, whose own hold on q's workers ends after it; the last
// worker to end carries out the end, on its goroutine (no goroutine is
// started for it: a hand-off would cost each request a wake-up).
func (r *rank) finish(q *rankReq, err error, release bool) {
	q.workers.Then(func() {
		if release {
			r.release(q)
		}
		q.cancel(nil)
		q.stats.end = r.set.now()
		if err != nil {
			r.log.Warn(roleOf(q.key.side)+" transfer failed", "request", q.reqID, "backend", q.stats.backend, "err", err)
		}
		r.report(q.reqID, roleOf(q.key.side), err, q.stats)
		r.done(r.idx, instKey{q.key.side, q.reqID}, err, q.stats.rankResult)
	})
}

// release gives q's blocks back: the references a send held, or the blocks
// a receipt armed for a direct transfer whose receive never started.
func (r *rank) release(q *rankReq) {
	if q.key.side == sideSend {
		if err := r.pool.Release(q.blocks...); err != nil {
			r.log.Error("release blocks", "request", q.reqID, "err", err)
		}
		return
	}
	for _, s := range q.srcs {
		if s.direct != nil {
			s.direct.Cancel() // a no-op once it has ended (filled or failed)
		}
	}
}

// Frame hands a control frame from cc to the request it is about (it
// implements control.Handler). dialled: cc is a connection this rank
// dialled, to a context rank.
func (r *rank) Frame(cc *control.Conn, f wire.Frame, dialled bool) error {
	key, ev, held, err := frameEvent(f, connID(cc.ID()), cc.Peer().Rank, dialled, time.Now())
	if err != nil || ev == nil {
		return err
	}
	r.feed(func() *rankReq { return r.reqs[key] }, ev, held)
	return nil
}

// Lost fails every transfer that used cc (it implements
// control.Handler).
func (r *rank) Lost(cc *control.Conn, err error) {
	id := connID(cc.ID())
	hit := r.usersOf(id)
	lost := fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, cc.Peer().Endpoint, err)
	for _, q := range hit {
		r.step(q, evConnLost{conn: id, err: lost})
	}
}

// Busy reports whether a request in flight uses cc (it implements
// control.Handler): the connection is then not idle.
func (r *rank) Busy(cc *control.Conn) bool { return len(r.usersOf(connID(cc.ID()))) > 0 }

// usersOf returns the cores that use connection id: requests in flight,
// and the ask hold when it holds asks from it.
func (r *rank) usersOf(id connID) []*rankReq {
	r.mu.Lock()
	defer r.mu.Unlock()
	var hit []*rankReq
	for _, q := range r.reqs {
		if slices.Contains(q.core.conns(), id) {
			hit = append(hit, q)
		}
	}
	return hit
}

// cancel cancels the instance's request reqID of side on this rank. It
// reports whether there was anything to cancel.
func (r *rank) cancel(s side, reqID uint64, why error) bool {
	var held event
	if s == sideSend {
		// Over on the instance before this rank was handed it: asks held
		// for it are refused.
		held = evHeldEnded{id: reqID, err: why}
	}
	return r.feed(r.byReqID(s, reqID), evCancel{err: why}, held) > 0
}

// decide feeds the instance's word on a pull attempt (evAttemptFailed,
// evCommit) to context request reqID on this rank.
func (r *rank) decide(reqID uint64, ev event) { r.feed(r.byReqID(sideSend, reqID), ev, nil) }

// byReqID finds, for feed, the request of side with the instance's id
// reqID.
func (r *rank) byReqID(s side, reqID uint64) func() *rankReq {
	return func() *rankReq {
		for k, q := range r.reqs {
			if k.side == s && q.reqID == reqID {
				return q
			}
		}
		return nil
	}
}

// close fails everything in flight, closes the listener, the connections
// and the transports, and waits for every goroutine of the rank.
func (r *rank) close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	r.deadlines.stop() // (each core is cancelled below)
	qs := slices.Collect(maps.Values(r.reqs))
	r.mu.Unlock()
	for _, q := range qs {
		r.step(q, evCancel{err: ErrClosed})
	}
	errs := []error{r.ctrl.Close()}
	r.links.Close() // (probes in progress end)
	r.goes.Close()
	for _, tr := range r.transports {
		errs = append(errs, tr.Close())
	}
	// Nothing moves now: the staging buffers go back to the system.
	errs = append(errs, r.sendBufs.Close(), r.recvBufs.Close())
	return errors.Join(errs...)
}

// stagingAlloc maps a staging buffer of its own (mover.Alloc): its pages
// come from the kernel zeroed and on first touch, where a buffer of the Go
// heap that reuses freed memory is zeroed whole at allocation (512 MiB by
// default: seconds on a machine whose page faults are slow, for a first
// transfer that may stage 64 KiB), and they go back to the system when the
// rank closes rather than when the collector and the scavenger get there.
func stagingAlloc(size int) ([]byte, func() error, error) {
	a, err := kvcache.MmapAllocator{}.Allocate(size)
	if errors.Is(err, errors.ErrUnsupported) {
		return make([]byte, size), func() error { return nil }, nil
	}
	if err != nil {
		return nil, nil, err
	}
	return a.Bytes(), a.Close, nil
}
