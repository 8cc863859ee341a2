package transceiver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// receive starts pulling context request op into blocks (this rank's, in
// request order). genState is the generation instance's state with the DP
// rank of this request.
func (r *rank) receive(reqID uint64, op *OpaqueState, genState layout.CacheState, blocks []kvcache.BlockID, lastHash *kvcache.Hash) error {
	srcs, err := layout.TargetRanks(op.State, genState, r.idx)
	if err != nil {
		return fmt.Errorf("transceiver: rank %d: context ranks of request %d: %w", r.idx, op.RequestID, err)
	}
	if len(blocks) == 0 {
		return fmt.Errorf("transceiver: rank %d: request %d has no blocks to receive into", r.idx, reqID)
	}
	hasData := map[int]bool{}
	gsrcs := map[int]*genSrc{}
	for _, c := range srcs {
		if c >= len(op.Endpoints) {
			return fmt.Errorf("%w: context rank %d has no endpoint", ErrBadOpaqueState, c)
		}
		plan, err := layout.NewPlan(op.State, c, genState, r.idx)
		if err != nil {
			return fmt.Errorf("transceiver: rank %d: plan from context rank %d: %w", r.idx, c, err)
		}
		hasData[c] = plan.PackedBytesPerBlock() > 0
		gsrcs[c] = &genSrc{rank: c, plan: plan}
	}
	mem := make([][]byte, len(blocks))
	for i, b := range blocks {
		mem[i] = r.pool.Block(b)
		if mem[i] == nil {
			return fmt.Errorf("transceiver: rank %d: block %d of request %d is not a pinned block of this rank's pool", r.idx, b, reqID)
		}
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	gr := &genReq{reqID: reqID, op: op, genState: genState, blocks: slices.Clone(blocks), mem: mem,
		core: newGenCore(srcs, hasData), srcs: gsrcs, ctx: ctx, cancel: cancel, lastHash: lastHash,
		stats: rankStats{start: r.set.now()}}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		cancel(ErrClosed)
		return ErrClosed
	}
	r.nextGen++
	gr.id = r.nextGen
	r.genReqs[gr.id] = gr
	if r.obs != nil {
		r.obs.TransferStarted(RoleGeneration)
	}
	gr.timer = time.AfterFunc(r.set.timeout, func() {
		r.stepGen(gr, func() []effect {
			return gr.core.timeout(fmt.Errorf("%w: request %d (context request %d) not received within %v", ErrTimeout, reqID, op.RequestID, r.set.timeout))
		})
	})
	effs := gr.core.start()
	// Until the start's effects are launched (their workers added), a
	// completion (a cancel from another rank can come at once) must not
	// hand the blocks back: it waits for this hold too.
	gr.workers.Add(1)
	r.mu.Unlock()
	r.execGen(gr, effs)
	gr.workers.Done()
	return nil
}

func (r *rank) stepGen(gr *genReq, ev func() []effect) {
	r.mu.Lock()
	effs := ev()
	r.mu.Unlock()
	r.execGen(gr, effs)
}

func (r *rank) execGen(gr *genReq, effs []effect) {
	for _, e := range effs {
		switch e.kind {
		case effAsk:
			s := gr.srcs[e.peer]
			r.wg.Add(1)
			gr.workers.Add(1)
			go func() {
				defer r.wg.Done()
				defer gr.workers.Done()
				if err := r.ask(gr, s); err != nil {
					r.stepGen(gr, func() []effect { return gr.core.fail(fmt.Errorf("ask context rank %d: %w", s.rank, err), s.rank) })
				}
			}()
		case effStartRecv:
			s := gr.srcs[e.peer]
			r.mu.Lock()
			if gr.stats.moving.IsZero() {
				gr.stats.moving = r.set.now()
			}
			r.mu.Unlock()
			r.wg.Add(1)
			gr.workers.Add(1)
			go func() {
				defer r.wg.Done()
				defer gr.workers.Done() // after the step: the completion reads the stats
				n, chunks, err := r.recvPair(gr, s)
				r.stepGen(gr, func() []effect {
					gr.stats.bytes += n
					gr.stats.chunks += chunks
					gr.stats.backend = s.tr.Name()
					return gr.core.received(s.rank, err)
				})
			}()
		case effAbort:
			r.mu.Lock()
			cc := gr.srcs[e.peer].conn
			r.mu.Unlock()
			if cc != nil {
				cc.send(&wire.Abort{CtxRequestID: gr.op.RequestID, GenRequestID: gr.id, Reason: e.reason})
			}
		case effStopAll:
			gr.cancel(ErrCanceled)
		case effComplete:
			gr.timer.Stop()
			r.mu.Lock()
			delete(r.genReqs, gr.id)
			for _, s := range gr.srcs {
				if s.conn != nil {
					s.conn.touch() // idle from now on, if nothing else uses it
				}
			}
			r.mu.Unlock()
			err := e.err
			r.wg.Add(1)
			go func() {
				// The blocks are the caller's again only when nothing
				// writes into them any more.
				defer r.wg.Done()
				gr.workers.Wait()
				// A zero-copy receipt armed by an ask whose receive never
				// started still owns the blocks: take them back.
				for _, s := range gr.srcs {
					if s.zrecv != nil {
						s.zrecv.Cancel()
					}
				}
				gr.cancel(nil)
				gr.stats.end = r.set.now()
				if err != nil {
					r.log.Warn("generation transfer failed", "request", gr.reqID, "ctx_request", gr.op.RequestID, "backend", gr.stats.backend, "err", err)
				}
				r.report(gr.reqID, RoleGeneration, err, gr.stats)
				r.done(r, true, gr.reqID, err, gr.stats)
			}()
		}
	}
}

// ask connects to context rank s, chooses the backend, arms the receipt of
// a direct transfer when the plan allows one (see directOK), and sends the
// request-info.
func (r *rank) ask(gr *genReq, s *genSrc) error {
	ctx := gr.ctx
	cc, err := r.dial(ctx, gr.op.Endpoints[s.rank])
	if err != nil {
		return err
	}
	defer r.undial(cc)
	backend, err := r.chooseBackend(cc)
	if err != nil {
		return err
	}
	tr := r.transports[backend]
	st, err := gr.genState.MarshalBinary()
	if err != nil {
		return err
	}
	ri := &wire.RequestInfo{CtxRequestID: gr.op.RequestID, Token: gr.op.Token, GenRequestID: gr.id, GenRank: uint32(r.idx),
		GenState: st, NumBlocks: uint32(len(gr.blocks)), Backend: backend}
	if gr.lastHash != nil {
		ri.HasLastHash, ri.LastHash = true, *gr.lastHash
	}
	packed := s.plan.PackedBytesPerBlock()
	if packed > 0 {
		ri.MaxChunkBlocks = uint32(max(1, int64(r.recvBufs.size)/packed))
	}
	r.mu.Lock()
	if gr.core.phase == phaseDone || gr.core.phase == phaseFailed {
		r.mu.Unlock()
		return nil
	}
	s.conn, s.backend, s.tr = cc, backend, tr
	r.mu.Unlock()
	if packed > 0 && r.set.zeroCopy && directOK(s.plan, len(gr.mem)) {
		rv, err := tr.Expect(segments(gr.mem, s.plan.DstSpans()))
		if err != nil {
			return err
		}
		r.mu.Lock()
		s.zrecv = rv
		r.mu.Unlock()
		ri.Desc = rv.Descriptor()
	}
	return cc.send(ri)
}

func (r *rank) chooseBackend(cc *ctrlConn) (string, error) {
	has := func(name string) bool {
		_, mine := r.transports[name]
		return mine && slices.Contains(cc.peer.backends, name)
	}
	if r.set.backend != "auto" {
		if !has(r.set.backend) {
			return "", fmt.Errorf("%w: backend %s: context rank %d at %s has %v open, this rank %v",
				transport.ErrNotBuilt, r.set.backend, cc.peer.rank, cc.peer.endpoint, cc.peer.backends, r.backendNames())
		}
		return r.set.backend, nil
	}
	if cc.peer.host == r.set.host && has("shm") {
		if err := r.probeShm(cc); err == nil {
			return "shm", nil
		} else {
			r.log.Info("shm not usable with this peer, falling back", "peer", cc.peer.endpoint, "peer_rank", cc.peer.rank, "reason", err)
		}
	}
	for _, b := range []string{"ucx", "tcp"} {
		if has(b) {
			return b, nil
		}
	}
	return "", fmt.Errorf("no backend in common with context rank %d at %s (it has %v, this rank %v)", cc.peer.rank, cc.peer.endpoint, cc.peer.backends, r.backendNames())
}

// probeShm checks once per control connection that this rank can reach
// the peer's shm endpoint and map memory with it (same host and namespace,
// working memory files); the answer is cached on the connection.
func (r *rank) probeShm(cc *ctrlConn) error {
	cc.probeOnce.Do(func() {
		i := slices.Index(cc.peer.backends, "shm")
		if i < 0 || i >= len(cc.peer.endpoints) {
			cc.probeErr = fmt.Errorf("the peer announced no shm endpoint")
			return
		}
		// The generation side receives; the context side sends. Probe in
		// the direction of the data: ask our shm transport to reach the
		// peer's (both directions need the same host and namespace).
		p, ok := r.transports["shm"].(transport.Prober)
		if !ok {
			cc.probeErr = fmt.Errorf("the shm backend cannot probe")
			return
		}
		ctx, cancel := context.WithTimeout(r.life, 5*time.Second)
		defer cancel()
		cc.probeErr = p.Probe(ctx, cc.peer.endpoints[i])
	})
	return cc.probeErr
}

// recvPair receives the chunks from source s and unpacks them into the
// request's blocks, keeping up to two chunks in flight when the rank has
// two receive buffers.
func (r *rank) recvPair(gr *genReq, s *genSrc) (int64, int, error) {
	ctx := gr.ctx
	packed := s.plan.PackedBytesPerBlock()
	n := len(gr.mem)
	if s.zrecv != nil {
		select {
		case <-s.zrecv.Done():
		case <-ctx.Done():
			s.zrecv.Cancel()
			return 0, 0, context.Cause(ctx)
		}
		if err := s.zrecv.Err(); err != nil {
			return 0, 0, err
		}
		return int64(n) * packed, 1, nil
	}
	if s.chunk <= 0 {
		return 0, 0, fmt.Errorf("%w: context rank %d announced chunks of %d blocks", wire.ErrMalformed, s.rank, s.chunk)
	}
	type slot struct {
		buf    []byte
		rv     transport.Recv
		lo, hi int
	}
	depth := min(2, r.recvBufs.count())
	var q []slot
	cleanup := func() {
		for _, sl := range q {
			sl.rv.Cancel()
			r.recvBufs.put(sl.buf)
		}
		q = nil
	}
	chunks := (n + s.chunk - 1) / s.chunk
	var got int64
	next := 0
	for done := 0; done < chunks; {
		for next < chunks && len(q) < depth {
			var buf []byte
			if len(q) == 0 {
				b, err := r.recvBufs.get(ctx)
				if err != nil {
					cleanup()
					return got, done, err
				}
				buf = b
			} else if b, ok := r.recvBufs.tryGet(); ok {
				buf = b
			} else {
				break
			}
			lo, hi := next*s.chunk, min(n, (next+1)*s.chunk)
			size := int64(hi-lo) * packed
			if size > int64(len(buf)) {
				r.recvBufs.put(buf)
				cleanup()
				return got, done, fmt.Errorf("%w: chunk of %d bytes does not fit a %d-byte receive buffer", wire.ErrMalformed, size, len(buf))
			}
			rv, err := s.tr.Expect([][]byte{buf[:size]})
			if err != nil {
				r.recvBufs.put(buf)
				cleanup()
				return got, done, err
			}
			q = append(q, slot{buf: buf, rv: rv, lo: lo, hi: hi})
			if err := s.conn.send(&wire.ChunkDesc{CtxRequestID: gr.op.RequestID, GenRequestID: gr.id, Index: uint32(next), Desc: rv.Descriptor()}); err != nil {
				cleanup()
				return got, done, err
			}
			next++
		}
		head := q[0]
		select {
		case <-head.rv.Done():
		case <-ctx.Done():
			cleanup()
			return got, done, context.Cause(ctx)
		}
		if err := head.rv.Err(); err != nil {
			cleanup()
			return got, done, err
		}
		size := int64(head.hi-head.lo) * packed
		err := s.plan.Unpack(gr.mem[head.lo:head.hi], head.buf[:size])
		r.recvBufs.put(head.buf)
		q = q[1:]
		if err != nil {
			cleanup()
			return got, done, err
		}
		got += size
		done++
	}
	return got, chunks, nil
}

// dial returns the control connection to a context rank's endpoint,
// connecting and shaking hands on first use. Concurrent callers for one
// endpoint share one attempt. The connection is the caller's to use until it
// calls undial: meanwhile it is not closed as idle. A cached connection that
// was closed (idle, lost) is replaced by a new one.
func (r *rank) dial(ctx context.Context, endpoint string) (*ctrlConn, error) {
	// RequestAndReceiveAsync has checked every endpoint already; this is
	// the one place that dials, so the rule is enforced here too.
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil, fmt.Errorf("%w: endpoint %q is not host:port", ErrBadOpaqueState, endpoint)
	}
	if err := r.set.peers.dialCheck(host); err != nil {
		return nil, err
	}
	for {
		d, err := r.dialEntry(ctx, endpoint)
		if err != nil {
			return nil, err
		}
		select {
		case <-d.ready:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		if d.err != nil {
			return nil, d.err
		}
		r.mu.Lock()
		if r.dialed[endpoint] == d {
			if !d.conn.isDead() {
				d.conn.users++
				r.mu.Unlock()
				return d.conn, nil
			}
			delete(r.dialed, endpoint) // before connLost gets to it
		}
		r.mu.Unlock()
	}
}

// undial ends a use of cc that dial started.
func (r *rank) undial(cc *ctrlConn) {
	r.mu.Lock()
	cc.users--
	cc.touch()
	r.mu.Unlock()
}

// genIdleLeft returns how much longer dialled connection cc must stay
// unused to have been idle for d: d while a caller of dial holds it or a
// generation request pulls through it. At 0 it is removed from the dial
// cache, so that nobody takes it any more.
func (r *rank) genIdleLeft(cc *ctrlConn, d time.Duration) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cc.users > 0 {
		return d
	}
	for _, gr := range r.genReqs {
		for _, s := range gr.srcs {
			if s.conn == cc {
				return d
			}
		}
	}
	if left := d - time.Since(cc.lastUse()); left > 0 {
		return left
	}
	if de := r.dialed[cc.peer.endpoint]; de != nil && de.conn == cc {
		delete(r.dialed, cc.peer.endpoint)
	}
	return 0
}

// dialEntry returns the dial cache's entry for endpoint, starting a
// connection attempt when there is none.
func (r *rank) dialEntry(ctx context.Context, endpoint string) (*dialEntry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	d, ok := r.dialed[endpoint]
	if !ok {
		d = &dialEntry{ready: make(chan struct{})}
		r.dialed[endpoint] = d
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			d.conn, d.err = r.connect(endpoint)
			if d.err != nil {
				r.mu.Lock()
				if r.dialed[endpoint] == d {
					delete(r.dialed, endpoint)
				}
				r.mu.Unlock()
			}
			close(d.ready)
		}()
	}
	return d, nil
}

// connect dials and shakes hands. It is bounded by writeTimeout so that a
// dead endpoint does not hold the dial slot forever.
func (r *rank) connect(endpoint string) (*ctrlConn, error) {
	dl := net.Dialer{Timeout: writeTimeout}
	c, err := dl.DialContext(r.life, "tcp", endpoint)
	if err != nil {
		return nil, fmt.Errorf("%w: dial context rank at %s: %v", ErrPeerLost, endpoint, err)
	}
	// Closing the rank interrupts a handshake in progress.
	raw := c
	stop := context.AfterFunc(r.life, func() { raw.SetDeadline(time.Now()) })
	defer stop()
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if r.set.tls != nil {
		hctx, cancel := context.WithTimeout(r.life, writeTimeout)
		c, err = dialTLS(hctx, c, r.set.tls, endpoint)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%w: TLS handshake with context rank at %s: %v", ErrPeerLost, endpoint, err)
		}
	}
	cc := newCtrlConn(c)
	cc.peer.endpoint = endpoint
	st, _ := r.state.MarshalBinary()
	if err := cc.send(&wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.backendNames(), Endpoints: r.backendEndpoints()}); err != nil {
		c.Close()
		return nil, err
	}
	c.SetReadDeadline(time.Now().Add(writeTimeout))
	f, err := wire.Read(cc.br)
	c.SetReadDeadline(time.Time{})
	if err != nil {
		c.Close()
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return nil, fmt.Errorf("%w: handshake with %s: %v (closed before its hello: refused by the peer's connection limits, or gone)", ErrPeerLost, endpoint, err)
		}
		return nil, fmt.Errorf("%w: handshake with %s: %v", ErrPeerLost, endpoint, err)
	}
	switch h := f.(type) {
	case *wire.Hello:
		cc.peer.rank, cc.peer.state, cc.peer.host, cc.peer.backends, cc.peer.endpoints = int(h.Rank), h.State, h.Host, h.Backends, h.Endpoints
	case *wire.Refused:
		c.Close()
		return nil, fmt.Errorf("%w by %s: %s", ErrRefused, endpoint, h.Reason)
	default:
		c.Close()
		return nil, fmt.Errorf("%w: handshake with %s: got %s", wire.ErrMalformed, endpoint, f.Type())
	}
	cc.touch()
	if !r.track(cc) {
		c.Close()
		return nil, ErrClosed
	}
	r.wg.Add(1)
	go r.serveGen(cc)
	return cc, nil
}

// serveGen reads the frames a context rank sends on a dialled connection,
// until it breaks, closes, or stays unused for 3/4 of the idle timeout
// (before the context rank's own idle timeout closes it: see ConnLimits).
func (r *rank) serveGen(cc *ctrlConn) {
	defer r.wg.Done()
	var err error
	for err == nil {
		var f wire.Frame
		f, err = r.nextFrame(cc, r.set.limits.dialIdle(), r.genIdleLeft)
		if errors.Is(err, errIdle) {
			r.log.Debug("dialled control connection closed: idle", "endpoint", cc.peer.endpoint)
		}
		if err != nil {
			break
		}
		switch f := f.(type) {
		case *wire.Ready:
			r.withSrc(cc, f.GenRequestID, func(gr *genReq, s *genSrc) {
				r.stepGen(gr, func() []effect {
					s.chunk = int(f.ChunkBlocks)
					return gr.core.readied(s.rank)
				})
			})
		case *wire.Refused:
			r.withSrc(cc, f.GenRequestID, func(gr *genReq, s *genSrc) {
				r.stepGen(gr, func() []effect { return gr.core.refused(s.rank, f.Reason) })
			})
		case *wire.Abort:
			r.withSrc(cc, f.GenRequestID, func(gr *genReq, s *genSrc) {
				r.stepGen(gr, func() []effect { return gr.core.peerAbort(s.rank, f.Reason) })
			})
		case *wire.Pong:
		case *wire.Ping:
			err = cc.send(&wire.Pong{Nonce: f.Nonce})
		default:
			err = fmt.Errorf("%w: unexpected %s frame from a context rank", wire.ErrMalformed, f.Type())
		}
	}
	if errors.Is(err, net.ErrClosed) {
		err = ErrClosed
	}
	r.connLost(cc, err)
}

func (r *rank) withSrc(cc *ctrlConn, genReqID uint64, fn func(*genReq, *genSrc)) {
	r.mu.Lock()
	gr := r.genReqs[genReqID]
	var s *genSrc
	if gr != nil {
		if src := gr.srcs[cc.peer.rank]; src != nil && src.conn == cc {
			s = src
		}
	}
	r.mu.Unlock()
	if s != nil {
		fn(gr, s)
	}
}

// cancelReq cancels a request on this rank, on either side.
func (r *rank) cancelCtx(id uint64, why error) bool {
	r.mu.Lock()
	cr := r.ctxReqs[id]
	if cr == nil {
		r.mu.Unlock()
		return false
	}
	effs, ok := cr.core.cancel(why)
	r.mu.Unlock()
	r.execCtx(cr, effs)
	return ok
}

func (r *rank) cancelGen(reqID uint64, why error) bool {
	r.mu.Lock()
	var gr *genReq
	for _, g := range r.genReqs {
		if g.reqID == reqID {
			gr = g
		}
	}
	if gr == nil {
		r.mu.Unlock()
		return false
	}
	effs, ok := gr.core.cancel(why)
	r.mu.Unlock()
	r.execGen(gr, effs)
	return ok
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
	var crs []*ctxReq
	for _, cr := range r.ctxReqs {
		crs = append(crs, cr)
	}
	var grs []*genReq
	for _, gr := range r.genReqs {
		grs = append(grs, gr)
	}
	r.mu.Unlock()
	for _, cr := range crs {
		r.stepCtx(cr, func() []effect { return cr.core.fail(ErrClosed, -1) })
	}
	for _, gr := range grs {
		r.stepGen(gr, func() []effect { return gr.core.fail(ErrClosed, -1) })
	}
	err := r.ln.Close()
	r.mu.Lock()
	conns := make([]*ctrlConn, 0, len(r.conns))
	for cc := range r.conns {
		conns = append(conns, cc)
	}
	r.mu.Unlock()
	for _, cc := range conns {
		cc.close(ErrClosed)
	}
	r.wg.Wait()
	for _, tr := range r.transports {
		if cerr := tr.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}
	return err
}
