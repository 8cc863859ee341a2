package transceiver

import (
	"context"
	"crypto/subtle"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// rankSettings are the per-rank settings derived from the public config by
// New (the only place that reads it).
type rankSettings struct {
	timeout     time.Duration
	backend     string // "tcp", "shm", "ucx" or "auto"
	bufferBytes int64  // staging buffer size, before rounding up to a block
	sendBuffers int
	recvBuffers int
	zeroCopy    bool
	host        string
	logger      *slog.Logger
	now         func() time.Time
	peers       *peerPolicy // hosts this rank may dial and accept
	tls         *tls.Config // client side of the control plane's mutual TLS; nil: plain TCP
	limits      ConnLimits  // with defaults
	conns       connObs     // the Observer's ConnObserver, if any
}

// rankDone is how a rank reports that its part of a request ended.
type rankDone func(r *rank, gen bool, reqID uint64, err error, st rankStats)

// rankStats are the figures of one request on one rank.
type rankStats struct {
	bytes   int64
	chunks  int
	backend string
	start   time.Time
	moving  time.Time // when data started to move; zero if it never did
	end     time.Time
}

// rank is one rank's transceiver: a control listener, the data planes, the
// staging buffers and the requests in flight.
//
// Lock order: rank.mu, then nothing (ctrlConn.wmu is never taken under
// rank.mu: effects run after the lock is released).
type rank struct {
	idx        int
	state      layout.CacheState // the instance's state (DP rank 0)
	pool       *kvcache.Pool
	set        rankSettings
	transports map[string]transport.Transport
	ln         *netlimit.Listener // the control listener, within set.limits
	refusals   *netlimit.RateLog  // connections dropped at their handshake
	sendBufs   *bufPool
	recvBufs   *bufPool
	done       rankDone
	log        *slog.Logger

	wg   sync.WaitGroup  // every goroutine of this rank
	life context.Context // ends when the rank closes: bounds dials and handshakes
	obs  Observer        // nil: none
	csv  *timingCSV      // nil: none
	stop context.CancelFunc

	mu      sync.Mutex
	closed  bool
	ctxReqs map[uint64]*ctxReq
	genReqs map[uint64]*genReq
	dialed  map[string]*dialEntry // generation side: control connection per context endpoint
	conns   map[*ctrlConn]struct{}
	nextGen uint64
}

type dialEntry struct {
	ready chan struct{} // closed when conn/err are set
	conn  *ctrlConn
	err   error
}

// ctxReq is a context request held by this rank until it is pulled.
type ctxReq struct {
	id     uint64
	token  [16]byte
	state  layout.CacheState
	blocks []kvcache.BlockID
	mem    [][]byte
	hashes []kvcache.Hash
	core   *ctxCore
	peers  map[int]*ctxPeer // by generation rank
	ctx    context.Context
	cancel context.CancelCauseFunc
	timer  *time.Timer
	stats  rankStats
	// workers counts the goroutines that may still touch mem; the request
	// is reported done (and its blocks released) only after they end.
	workers sync.WaitGroup
}

// ctxPeer is one generation rank that asked for a context request.
type ctxPeer struct {
	rank     int
	conn     *ctrlConn
	genReqID uint64
	plan     *layout.Plan
	first, n int // blocks [first, first+n) of the request
	chunk    int
	backend  string
	zdesc    transport.Descriptor // receipt of a direct transfer (no staging)
	descs    chan chunkDesc
}

type chunkDesc struct {
	index int
	desc  transport.Descriptor
}

// genReq is a generation request pulling into this rank's blocks.
type genReq struct {
	id       uint64
	reqID    uint64 // the instance's request id (for reports)
	op       *OpaqueState
	genState layout.CacheState
	blocks   []kvcache.BlockID
	mem      [][]byte
	core     *genCore
	srcs     map[int]*genSrc // by context rank
	ctx      context.Context
	cancel   context.CancelCauseFunc
	timer    *time.Timer
	stats    rankStats
	lastHash *kvcache.Hash
	workers  sync.WaitGroup // goroutines that may still write into mem
}

// genSrc is one context rank a generation request pulls from.
type genSrc struct {
	rank    int
	plan    *layout.Plan
	conn    *ctrlConn
	backend string
	tr      transport.Transport
	chunk   int
	zrecv   transport.Recv // armed before asking, for zero-copy
}

func newRank(idx int, state layout.CacheState, pool *kvcache.Pool, set rankSettings, trs map[string]transport.Transport, ln net.Listener, done rankDone) *rank {
	bb := max(set.bufferBytes, pool.BlockBytes())
	if bb > 1<<40 {
		bb = 1 << 40
	}
	life, stop := context.WithCancel(context.Background())
	return &rank{
		life: life, stop: stop,
		idx: idx, state: state, pool: pool, set: set, transports: trs, done: done,
		ln: netlimit.NewListener(ln, fmt.Sprintf("control rank %d", idx), netlimit.Limits{
			MaxConns: set.limits.MaxControlConns, MaxConnsPerHost: set.limits.MaxControlConnsPerHost}, set.logger, set.conns),
		refusals: netlimit.NewRateLog(set.logger, time.Second),
		sendBufs: newBufPool(set.sendBuffers, int(bb)),
		recvBufs: newBufPool(set.recvBuffers, int(bb)),
		log:      set.logger.With("rank", idx),
		ctxReqs:  map[uint64]*ctxReq{}, genReqs: map[uint64]*genReq{},
		dialed: map[string]*dialEntry{}, conns: map[*ctrlConn]struct{}{},
	}
}

func (r *rank) endpoint() string { return r.ln.Addr().String() }

func (r *rank) backendNames() []string {
	names := make([]string, 0, len(r.transports))
	for n := range r.transports {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// registerMemory declares the rank's pool arena to every backend that
// wants memory registered. Staging buffers stay private heap memory: no
// backend hands a peer a pool or a staging buffer (shm copies each part
// into a window of the connection; see transport/shm).
func (r *rank) registerMemory() error {
	arena := r.pool.Arena()
	var f *os.File
	if sa, ok := arena.(*kvcache.ShmArena); ok {
		f = sa.File()
	}
	for _, n := range r.backendNames() {
		if mr, ok := r.transports[n].(transport.MemoryRegistrar); ok {
			if err := mr.RegisterMemory(arena.Bytes(), f); err != nil {
				return fmt.Errorf("transceiver: rank %d: register the pool: %w", r.idx, err)
			}
		}
	}
	return nil
}

// report hands a finished transfer to the observer and the timing file.
func (r *rank) report(id uint64, role string, err error, st rankStats) {
	rec := st.record(id, r.idx, role, err)
	if r.obs != nil {
		r.obs.TransferEnded(rec)
	}
	r.csv.write(rec)
}

// backendEndpoints returns the data-plane endpoint of each backend, in the
// order of backendNames.
func (r *rank) backendEndpoints() []string {
	names := r.backendNames()
	eps := make([]string, len(names))
	for i, n := range names {
		eps[i] = r.transports[n].Endpoint()
	}
	return eps
}

// start runs the accept loop.
func (r *rank) start() {
	r.wg.Add(1)
	go r.acceptLoop()
}

// acceptLoop accepts control connections within the rank's limits (the
// listener closes the others at once) until the listener closes.
func (r *rank) acceptLoop() {
	defer r.wg.Done()
	var delay time.Duration
	for {
		c, err := r.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// Out of file descriptors and the like: back off as net/http
			// does instead of spinning, or ending the control plane.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			r.log.Warn("control listener: accept failed; retrying", "err", err, "delay", delay)
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-r.life.Done():
				t.Stop()
				return
			}
			continue
		}
		delay = 0
		if !r.set.peers.acceptOK(c.RemoteAddr()) {
			r.set.peers.logRefusal(r.log, c.RemoteAddr())
			c.Close()
			continue
		}
		if tc, ok := netlimit.Unwrap(c).(*net.TCPConn); ok {
			tc.SetNoDelay(true)
		}
		cc := newCtrlConn(c)
		cc.peer.endpoint = c.RemoteAddr().String()
		cc.touch()
		if !r.track(cc) {
			c.Close()
			return
		}
		r.wg.Add(1)
		go r.serveCtx(cc)
	}
}

func (r *rank) track(cc *ctrlConn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[cc] = struct{}{}
	return true
}

// ---------------------------------------------------------------------------
// Context side.

// respond registers a context request: its blocks are retained until the
// transfer ends or the deadline passes.
func (r *rank) respond(id uint64, token [16]byte, state layout.CacheState, blocks []kvcache.BlockID, hashes []kvcache.Hash) error {
	if err := r.pool.Retain(blocks...); err != nil {
		return fmt.Errorf("transceiver: rank %d: hold blocks of request %d: %w", r.idx, id, err)
	}
	mem := make([][]byte, len(blocks))
	for i, b := range blocks {
		mem[i] = r.pool.Block(b)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	cr := &ctxReq{id: id, token: token, state: state, blocks: slices.Clone(blocks), mem: mem, hashes: hashes,
		core: newCtxCore(), peers: map[int]*ctxPeer{}, ctx: ctx, cancel: cancel, stats: rankStats{start: r.set.now()}}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		cancel(ErrClosed)
		r.pool.Release(blocks...)
		return ErrClosed
	}
	if _, dup := r.ctxReqs[id]; dup {
		r.mu.Unlock()
		cancel(nil)
		r.pool.Release(blocks...)
		return fmt.Errorf("transceiver: rank %d: context request %d is already in flight", r.idx, id)
	}
	r.ctxReqs[id] = cr
	if r.obs != nil {
		r.obs.TransferStarted(RoleContext)
	}
	cr.timer = time.AfterFunc(r.set.timeout, func() {
		r.stepCtx(cr, func() []effect {
			return cr.core.timeout(fmt.Errorf("%w: context request %d not pulled and sent within %v", ErrTimeout, id, r.set.timeout))
		})
	})
	r.mu.Unlock()
	return nil
}

// stepCtx runs one event of a context request under the lock and carries
// out its effects after.
func (r *rank) stepCtx(cr *ctxReq, ev func() []effect) {
	r.mu.Lock()
	effs := ev()
	r.mu.Unlock()
	r.execCtx(cr, effs)
}

func (r *rank) execCtx(cr *ctxReq, effs []effect) {
	for _, e := range effs {
		switch e.kind {
		case effRefuse:
			// Refusals of an ask are sent by the ask handler, which knows
			// the connection; see handleAsk.
		case effReady:
			p := cr.peers[e.peer]
			p.conn.send(&wire.Ready{CtxRequestID: cr.id, GenRequestID: p.genReqID, ChunkBlocks: uint32(p.chunk)})
		case effStartSend:
			p := cr.peers[e.peer]
			r.mu.Lock()
			if cr.stats.moving.IsZero() {
				cr.stats.moving = r.set.now()
			}
			r.mu.Unlock()
			r.wg.Add(1)
			cr.workers.Add(1)
			go func() {
				defer r.wg.Done()
				defer cr.workers.Done() // after the step: the completion reads the stats
				n, chunks, err := r.sendPair(cr, p)
				r.stepCtx(cr, func() []effect {
					cr.stats.bytes += n
					cr.stats.chunks += chunks
					cr.stats.backend = r.transports[p.backend].Name()
					return cr.core.sent(p.rank, err)
				})
			}()
		case effAbort:
			if p := cr.peers[e.peer]; p != nil {
				p.conn.send(&wire.Abort{CtxRequestID: cr.id, GenRequestID: p.genReqID, Reason: e.reason})
			}
		case effStopAll:
			cr.cancel(ErrCanceled)
		case effComplete:
			cr.timer.Stop()
			r.mu.Lock()
			delete(r.ctxReqs, cr.id)
			for _, p := range cr.peers {
				p.conn.touch() // idle from now on, if nothing else uses it
			}
			r.mu.Unlock()
			err := e.err
			r.wg.Add(1)
			go func() {
				// Blocks go back only once no send reads them any more.
				defer r.wg.Done()
				cr.workers.Wait()
				cr.cancel(nil)
				if rerr := r.pool.Release(cr.blocks...); rerr != nil {
					r.log.Error("release blocks", "request", cr.id, "err", rerr)
				}
				cr.stats.end = r.set.now()
				if err != nil {
					r.log.Warn("context transfer failed", "request", cr.id, "backend", cr.stats.backend, "peers", len(cr.peers), "err", err)
				}
				r.report(cr.id, RoleContext, err, cr.stats)
				r.done(r, false, cr.id, err, cr.stats)
			}()
		}
	}
}

// serveCtx reads the frames of one accepted control connection, until it
// breaks, closes, or stays idle for the idle timeout.
func (r *rank) serveCtx(cc *ctrlConn) {
	defer r.wg.Done()
	err := r.handshakeCtx(cc)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		r.set.conns.Refused(RefusedHandshakeTimeout)
		r.refusals.Warn(RefusedHandshakeTimeout, "control connection closed: no hello in time", "rank", r.idx,
			"remote", cc.peer.endpoint, "timeout", r.set.limits.HandshakeTimeout)
	}
	for err == nil {
		var f wire.Frame
		f, err = r.nextFrame(cc, r.set.limits.IdleTimeout, r.ctxIdleLeft)
		if errors.Is(err, errIdle) {
			r.set.conns.idleClosed()
			r.log.Debug("control connection closed: idle", "remote", cc.peer.endpoint, "idle_timeout", r.set.limits.IdleTimeout)
		}
		if err != nil {
			break
		}
		switch f := f.(type) {
		case *wire.RequestInfo:
			r.handleAsk(cc, f)
		case *wire.ChunkDesc:
			r.handleChunkDesc(cc, f)
		case *wire.Abort:
			r.withPeer(cc, f.CtxRequestID, f.GenRequestID, func(cr *ctxReq, p *ctxPeer) {
				r.stepCtx(cr, func() []effect { return cr.core.peerAbort(p.rank, f.Reason) })
			})
		case *wire.Ping:
			err = cc.send(&wire.Pong{Nonce: f.Nonce})
		default:
			err = fmt.Errorf("%w: unexpected %s frame from a generation rank", wire.ErrMalformed, f.Type())
		}
	}
	r.connLost(cc, err)
}

func (r *rank) handshakeCtx(cc *ctrlConn) error {
	if d := r.set.limits.HandshakeTimeout; d > 0 {
		cc.c.SetReadDeadline(time.Now().Add(d))
	}
	f, err := wire.Read(cc.br)
	cc.c.SetReadDeadline(time.Time{})
	if err != nil {
		return fmt.Errorf("handshake: %w", err)
	}
	h, ok := f.(*wire.Hello)
	if !ok {
		return fmt.Errorf("%w: handshake: want hello, got %s", wire.ErrMalformed, f.Type())
	}
	if h.Version != wire.Version {
		reason := fmt.Sprintf("control protocol version %d, this context rank speaks %d", h.Version, wire.Version)
		cc.send(&wire.Refused{Code: wire.RefusedVersion, Reason: reason})
		return errors.New(reason)
	}
	cc.peer.rank, cc.peer.state, cc.peer.host, cc.peer.backends, cc.peer.endpoints = int(h.Rank), h.State, h.Host, h.Backends, h.Endpoints
	st, _ := r.state.MarshalBinary()
	cc.touch()
	return cc.send(&wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.backendNames(), Endpoints: r.backendEndpoints()})
}

// errIdle ends a control connection closed for idleness.
var errIdle = errors.New("transceiver: control connection idle")

// frameTimeout bounds the arrival of a frame once its first byte has: a
// peer that starts a frame and stalls is gone (or hostile).
const frameTimeout = writeTimeout

// nextFrame reads cc's next frame. Between frames it waits for the first
// byte at most idle (no bound when idle <= 0); when that passes, idleLeft
// says how much longer cc must stay unused to be idle: 0 ends the wait
// with errIdle (idleLeft has then made sure nobody takes cc any more).
func (r *rank) nextFrame(cc *ctrlConn, idle time.Duration, idleLeft func(*ctrlConn, time.Duration) time.Duration) (wire.Frame, error) {
	wait := idle
	for {
		if idle > 0 {
			cc.c.SetReadDeadline(time.Now().Add(wait))
		} else {
			cc.c.SetReadDeadline(time.Time{})
		}
		_, err := cc.br.Peek(1)
		if err == nil {
			break
		}
		if idle <= 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
		if wait = idleLeft(cc, idle); wait <= 0 {
			return nil, errIdle
		}
	}
	cc.c.SetReadDeadline(time.Now().Add(frameTimeout))
	f, err := wire.Read(cc.br)
	cc.touch()
	return f, err
}

// ctxIdleLeft returns how much longer accepted connection cc must stay
// unused to have been idle for d: d while a context request has a peer on
// it, 0 when it is idle.
func (r *rank) ctxIdleLeft(cc *ctrlConn, d time.Duration) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, cr := range r.ctxReqs {
		for _, p := range cr.peers {
			if p.conn == cc {
				return d
			}
		}
	}
	return max(0, d-time.Since(cc.lastUse()))
}

func (r *rank) refuse(cc *ctrlConn, ri *wire.RequestInfo, code uint8, format string, args ...any) {
	reason := fmt.Sprintf(format, args...)
	r.log.Info("refused request-info", "request", ri.CtxRequestID, "gen_rank", ri.GenRank, "from", cc.peer.endpoint, "reason", reason)
	cc.send(&wire.Refused{CtxRequestID: ri.CtxRequestID, GenRequestID: ri.GenRequestID, Code: code, Reason: reason})
}

// handleAsk validates a request-info and feeds it to the request's core.
func (r *rank) handleAsk(cc *ctrlConn, ri *wire.RequestInfo) {
	r.mu.Lock()
	cr := r.ctxReqs[ri.CtxRequestID]
	r.mu.Unlock()
	// An unknown id and a wrong token get the same answer, so that the
	// answer does not tell a stranger which ids exist.
	if cr == nil || subtle.ConstantTimeCompare(cr.token[:], ri.Token[:]) != 1 {
		if cr != nil {
			r.log.Warn("request-info with a wrong transfer token", "request", ri.CtxRequestID, "from", cc.peer.endpoint)
		}
		r.refuse(cc, ri, wire.RefusedUnknown, "context request %d is not held by context rank %d (unknown id or wrong token, expired, cancelled or already transferred)", ri.CtxRequestID, r.idx)
		return
	}
	var gen layout.CacheState
	if err := gen.UnmarshalBinary(ri.GenState); err != nil {
		r.refuse(cc, ri, wire.RefusedBadRequest, "generation cache state: %v", err)
		return
	}
	if err := layout.Compatible(cr.state, gen); err != nil {
		r.refuse(cc, ri, wire.RefusedIncompatible, "%v", err)
		return
	}
	g := int(ri.GenRank)
	if g >= gen.Parallel.NumRanks() {
		r.refuse(cc, ri, wire.RefusedBadRequest, "generation rank %d out of range for %d ranks", g, gen.Parallel.NumRanks())
		return
	}
	expected, err := layout.TargetRanks(gen, cr.state, r.idx)
	if err != nil {
		r.refuse(cc, ri, wire.RefusedIncompatible, "%v", err)
		return
	}
	plan, err := layout.NewPlan(cr.state, r.idx, gen, g)
	if err != nil {
		r.refuse(cc, ri, wire.RefusedIncompatible, "%v", err)
		return
	}
	n := int(ri.NumBlocks)
	first := len(cr.blocks) - n
	if ri.HasLastHash {
		end := slices.IndexFunc(cr.hashes, func(h kvcache.Hash) bool { return h == kvcache.Hash(ri.LastHash) })
		if end < 0 {
			r.refuse(cc, ri, wire.RefusedBadRequest, "no block of context request %d has the requested last-block hash", cr.id)
			return
		}
		first = end + 1 - n
	}
	if n <= 0 || first < 0 {
		r.refuse(cc, ri, wire.RefusedBadRequest, "asked for %d blocks, context request %d has %d", n, cr.id, len(cr.blocks))
		return
	}
	if _, ok := r.transports[ri.Backend]; !ok {
		r.refuse(cc, ri, wire.RefusedUnavailable, "backend %q is not open on context rank %d (open: %v)", ri.Backend, r.idx, r.backendNames())
		return
	}
	p := &ctxPeer{rank: g, conn: cc, genReqID: ri.GenRequestID, plan: plan, first: first, n: n, backend: ri.Backend,
		descs: make(chan chunkDesc, 64)}
	packed := plan.PackedBytesPerBlock()
	switch {
	case packed == 0:
	case len(ri.Desc) > 0:
		if !directOK(plan, n) {
			r.refuse(cc, ri, wire.RefusedBadRequest, "a direct transfer was asked for a plan whose spans are too small for one")
			return
		}
		p.zdesc, p.chunk = ri.Desc, n
	default:
		p.chunk = max(1, min(int(ri.MaxChunkBlocks), int(int64(r.sendBufs.size)/packed), n))
	}
	r.mu.Lock()
	if r.ctxReqs[cr.id] != cr {
		r.mu.Unlock()
		r.refuse(cc, ri, wire.RefusedUnknown, "context request %d is no longer held", cr.id)
		return
	}
	effs := cr.core.ask(g, expected, packed > 0)
	if !slices.ContainsFunc(effs, func(e effect) bool { return e.kind == effRefuse }) {
		cr.peers[g] = p
	}
	r.mu.Unlock()
	for _, e := range effs {
		if e.kind == effRefuse {
			r.refuse(cc, ri, wire.RefusedBadRequest, "%s", e.reason)
		}
	}
	r.execCtx(cr, effs)
}

func (r *rank) withPeer(cc *ctrlConn, ctxID, genReqID uint64, fn func(*ctxReq, *ctxPeer)) {
	r.mu.Lock()
	cr := r.ctxReqs[ctxID]
	var p *ctxPeer
	if cr != nil {
		for _, q := range cr.peers {
			if q.conn == cc && q.genReqID == genReqID {
				p = q
			}
		}
	}
	r.mu.Unlock()
	if p != nil {
		fn(cr, p)
	}
}

func (r *rank) handleChunkDesc(cc *ctrlConn, f *wire.ChunkDesc) {
	r.withPeer(cc, f.CtxRequestID, f.GenRequestID, func(cr *ctxReq, p *ctxPeer) {
		select {
		case p.descs <- chunkDesc{index: int(f.Index), desc: f.Desc}:
		default:
			r.stepCtx(cr, func() []effect {
				return cr.core.peerAbort(p.rank, "more chunk descriptors outstanding than any receiver may have")
			})
		}
	})
}

// sendPair sends the request's bytes for generation peer p: straight from
// the blocks when zero-copy was agreed, else chunk by chunk through a send
// staging buffer.
func (r *rank) sendPair(cr *ctxReq, p *ctxPeer) (int64, int, error) {
	ctx := cr.ctx
	tr := r.transports[p.backend]
	blocks := cr.mem[p.first : p.first+p.n]
	if p.zdesc != nil {
		err := tr.Send(ctx, p.zdesc, segments(blocks, p.plan.SrcSpans()))
		if err != nil {
			return 0, 0, err
		}
		return int64(p.n) * p.plan.PackedBytesPerBlock(), 1, nil
	}
	packed := p.plan.PackedBytesPerBlock()
	var sent int64
	chunks := 0
	for i, lo := 0, 0; lo < p.n; i, lo = i+1, lo+p.chunk {
		hi := min(lo+p.chunk, p.n)
		var d chunkDesc
		select {
		case d = <-p.descs:
		case <-ctx.Done():
			return sent, chunks, context.Cause(ctx)
		}
		if d.index != i {
			return sent, chunks, fmt.Errorf("%w: chunk descriptor %d, expected %d", wire.ErrMalformed, d.index, i)
		}
		buf, err := r.sendBufs.get(ctx)
		if err != nil {
			return sent, chunks, err
		}
		n := int64(hi-lo) * packed
		if err := p.plan.Pack(buf[:n], blocks[lo:hi]); err != nil {
			r.sendBufs.put(buf)
			return sent, chunks, err
		}
		err = tr.Send(ctx, d.desc, [][]byte{buf[:n]})
		r.sendBufs.put(buf)
		if err != nil {
			return sent, chunks, err
		}
		sent += n
		chunks++
	}
	return sent, chunks, nil
}

// connLost fails every transfer that used cc.
func (r *rank) connLost(cc *ctrlConn, err error) {
	if err == nil || errors.Is(err, io.EOF) {
		err = io.EOF
	}
	cc.close(err)
	r.mu.Lock()
	delete(r.conns, cc)
	for ep, d := range r.dialed {
		select {
		case <-d.ready:
			if d.conn == cc {
				delete(r.dialed, ep)
			}
		default:
		}
	}
	var ctxHit []*ctxReq
	var ctxPeers []int
	for _, cr := range r.ctxReqs {
		for g, p := range cr.peers {
			if p.conn == cc {
				ctxHit, ctxPeers = append(ctxHit, cr), append(ctxPeers, g)
			}
		}
	}
	var genHit []*genReq
	var genSrcs []int
	for _, gr := range r.genReqs {
		for c, s := range gr.srcs {
			if s.conn == cc {
				genHit, genSrcs = append(genHit, gr), append(genSrcs, c)
			}
		}
	}
	r.mu.Unlock()
	lost := fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, cc.peer.endpoint, err)
	for i, cr := range ctxHit {
		r.stepCtx(cr, func() []effect { return cr.core.fail(lost, ctxPeers[i]) })
	}
	for i, gr := range genHit {
		r.stepGen(gr, func() []effect { return gr.core.fail(lost, genSrcs[i]) })
	}
}
