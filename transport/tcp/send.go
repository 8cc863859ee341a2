package tcp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// peer is the pool of outbound connections to one receiver endpoint: one
// slot per stream, dialled lazily, emptied when its connection breaks so
// that a later Send redials.
type peer struct {
	t    *Transport
	addr string
	tls  *tls.Config // Transport.cliTLS with the server name of addr; nil without TLS

	mu    sync.Mutex
	slots []*outConn // nil: not dialled, or dropped
	// aborts are the tags whose ABORT no Send could deliver within
	// writeGrace, left to deliverAborts, which runs while aborting.
	aborts   []uint64
	aborting bool
}

// outConn is one pooled outbound connection.
type outConn struct {
	p    *peer
	slot int
	nc   net.Conn // what frames are written to: raw, or a *tls.Conn over it
	raw  net.Conn // the TCP connection; closing it ends nc at once
	// tls: nc is a TLS connection, whose writes cannot resume after an
	// error (crypto/tls makes every write error permanent).
	tls bool
	// batch gathers the TLS records of a frame; nil without TLS.
	batch *batchConn
	// lock is the write lock, held for one whole frame so that frames of
	// concurrent Sends interleave only at frame boundaries. A channel, so
	// that waiting for it can end with ctx.
	lock chan struct{}

	// Guarded by lock.
	hdr  [headerLen]byte
	vec  [][]byte
	bufs net.Buffers

	mu       sync.Mutex
	owner    *sendOp // the Send writing a frame now
	deadline bool    // a write deadline is set

	// used is when a Send last took the connection or a frame ended on
	// it (unix nanoseconds): the pool retires it after idleRetire.
	used atomic.Int64
}

// sendOp is one Send in flight.
type sendOp struct {
	p       *peer
	tag     uint64
	total   int64
	frame   int64
	nframes int64
	src     receipt.Pieces
	ctx     context.Context
	cancel  context.CancelCauseFunc
	next    atomic.Int64 // next frame to take
	sent    atomic.Int64 // frames written completely

	mu    sync.Mutex
	conns []*outConn // connections its streams write on
}

// Send cuts src into frames of at most Options.FrameBytes and writes them
// over up to Options.Streams pooled connections to the receiver in desc, in
// parallel (frames are taken from a shared counter, so a slower stream takes
// fewer). Each frame is one vectored write of its header and the pieces of
// src it covers; src is never copied.
//
// When ctx ends, each stream stops before its next frame; a frame being
// written gets writeGrace to finish, after which the write fails and its
// connection, now corrupt, is closed and dropped from the pool. Send then
// writes an ABORT frame for the tag on a live connection to the peer (dialled
// for the purpose, within writeGrace, if there is none) and returns an error
// wrapping ctx.Err(), a *transport.TimeoutError for a deadline. An ABORT that
// no connection took within writeGrace (a receiver that stalls) is delivered
// after Send returns, for up to abortPatience. Close of the
// Transport does the same and Send returns a *transport.ClosedError. A
// broken connection or a peer that cannot be reached fails Send with
// transport.ErrPeerLost (after an ABORT on any other live connection).
func (t *Transport) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	d, err := descFormat.Decode(desc)
	if err != nil {
		return err
	}
	pieces, total := receipt.MakePieces(src)
	if total != d.Total {
		return descFormat.Bad("the receipt is for %d bytes, src has %d", d.Total, total)
	}

	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	frame := int64(t.opts.FrameBytes)
	op := &sendOp{
		tag: d.Tag, total: total, frame: frame, nframes: (total + frame - 1) / frame,
		src: pieces, ctx: sctx, cancel: cancel,
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return &transport.ClosedError{Op: "send"}
	}
	p := t.peers[d.Endpoint]
	if p == nil {
		p = &peer{t: t, addr: d.Endpoint, slots: make([]*outConn, t.opts.Streams)}
		if t.cliTLS != nil {
			p.tls = t.cliTLS
			if p.tls.ServerName == "" {
				// Verify the receiver's certificate against the host
				// of its endpoint (an IP address or a name).
				p.tls = p.tls.Clone()
				p.tls.ServerName, _, _ = net.SplitHostPort(d.Endpoint)
			}
		}
		t.peers[d.Endpoint] = p
	}
	op.p = p
	t.ops[op] = struct{}{}
	t.sends.Add(1)
	t.mu.Unlock()
	defer func() {
		t.mu.Lock()
		delete(t.ops, op)
		t.mu.Unlock()
		t.sends.Done()
	}()

	// When the Send ends early, a frame write in progress gets writeGrace.
	interrupted := make(chan struct{})
	stop := context.AfterFunc(sctx, func() {
		defer close(interrupted)
		op.interrupt()
	})
	err = op.run()
	if !stop() {
		<-interrupted // owned by this Send: do not return while it runs
	}
	if err == nil {
		return nil
	}

	var ret error
	dial := true // whether to dial a connection for the ABORT if none is live
	switch cerr := ctx.Err(); {
	case errors.Is(cerr, context.DeadlineExceeded):
		ret = &transport.TimeoutError{Op: "send", Peer: d.Endpoint, Err: cerr}
	case cerr != nil:
		ret = fmt.Errorf("tcp: send to %s: %w", d.Endpoint, cerr)
	case isClosed(context.Cause(sctx)):
		ret = &transport.ClosedError{Op: "send"}
	default:
		ret, dial = peerLost("send to", d.Endpoint, err), false
	}
	if !op.abort(dial) && !isClosed(ret) {
		p.abortLater(op.tag)
	}
	return ret
}

func isClosed(err error) bool {
	var ce *transport.ClosedError
	return errors.As(err, &ce)
}

// run writes every frame and returns nil, or the first error.
func (op *sendOp) run() error {
	n := int(min(int64(len(op.p.slots)), op.nframes))
	if n == 1 {
		return op.stream(0)
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := 1; i < n; i++ {
		wg.Go(func() { errs[i] = op.stream(i) })
	}
	errs[0] = op.stream(0)
	wg.Wait()
	if op.sent.Load() == op.nframes {
		return nil // a stream that could not dial was not missed
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return errors.New("tcp: send: internal error: frames left unsent")
}

// stream writes frames on connection slot i until none are left. A failure
// to dial fails only this stream: the others take its frames. (A stream
// still dialling when the others have taken every frame is waited for, so
// that the connection joins the pool instead of being dialled again by
// every Send.) A failed frame write fails the whole Send.
func (op *sendOp) stream(i int) error {
	oc, err := op.p.conn(op.ctx, i)
	if err != nil {
		if op.ctx.Err() != nil {
			return context.Cause(op.ctx)
		}
		return err
	}
	op.mu.Lock()
	op.conns = append(op.conns, oc)
	op.mu.Unlock()
	for {
		if op.ctx.Err() != nil {
			return context.Cause(op.ctx)
		}
		k := op.next.Add(1) - 1
		if k >= op.nframes {
			return nil
		}
		if err := oc.writeFrame(op, k); err != nil {
			op.cancel(err)
			return err
		}
		op.sent.Add(1)
	}
}

// interrupt gives the frames of op being written writeGrace to finish.
func (op *sendOp) interrupt() {
	op.mu.Lock()
	defer op.mu.Unlock()
	for _, oc := range op.conns {
		oc.mu.Lock()
		if oc.owner == op && !oc.deadline {
			oc.nc.SetWriteDeadline(time.Now().Add(writeGrace))
			oc.deadline = true
		}
		oc.mu.Unlock()
	}
}

// abort tells the receiver, best effort, that op will not complete: an ABORT
// frame on the first live connection that takes it within writeGrace, or,
// when dial is set, on a connection dialled for it. It reports whether one
// took it.
func (op *sendOp) abort(dial bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), writeGrace)
	defer cancel()
	p := op.p
	p.mu.Lock()
	live := make([]*outConn, 0, len(p.slots))
	for _, oc := range p.slots {
		if oc != nil {
			live = append(live, oc)
		}
	}
	p.mu.Unlock()
	for _, oc := range live {
		if oc.writeAbort(ctx, op.tag) == nil {
			return true
		}
	}
	if !dial {
		return false
	}
	for i := range p.slots {
		if oc, err := p.conn(ctx, i); err == nil && oc.writeAbort(ctx, op.tag) == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
	}
	return false
}

// abortPatience bounds how long a Transport goes on trying to deliver the
// ABORT of a Send that could not deliver it within writeGrace: long enough
// for a receiver that stalled (a paused process, a swapping machine) to
// read again, far shorter than the idle timeout after which it would drop
// the connection anyway. The receipt's owner ends it at its own deadline
// if the ABORT never arrives.
const abortPatience = 30 * time.Second

// abortRetry is the pause between two tries to deliver late ABORTs to a
// receiver that did not answer the last one in time.
const abortRetry = 100 * time.Millisecond

// abortLater leaves the ABORT for tag to deliverAborts, started unless it
// runs. Called only inside a Send, which Close waits for before it waits
// for the goroutine.
func (p *peer) abortLater(tag uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.aborts = append(p.aborts, tag)
	if !p.aborting {
		p.aborting = true
		p.t.wg.Add(1)
		go p.deliverAborts()
	}
}

// deliverAborts writes the ABORTs left to it on a connection of its own,
// dialled for them and closed after, until none is left. It gives up on
// those it has, and ends, at abortPatience, when the receiver refuses the
// connection (its receipts went with it), or when the Transport closes.
func (p *peer) deliverAborts() {
	defer p.t.wg.Done()
	ctx, cancel := context.WithTimeout(p.t.life, abortPatience)
	defer cancel()
	var tags []uint64
	refused := false
	for {
		p.mu.Lock()
		tags = append(tags, p.aborts...)
		p.aborts = nil
		if len(tags) == 0 || refused || ctx.Err() != nil {
			p.aborting = false
			p.mu.Unlock()
			break
		}
		p.mu.Unlock()
		var err error
		tags, err = p.writeAborts(ctx, tags)
		var ne net.Error
		refused = err != nil && !(errors.As(err, &ne) && ne.Timeout())
		if err != nil && !refused {
			select { // the receiver did not answer in time: again, shortly
			case <-ctx.Done():
			case <-time.After(abortRetry):
			}
		}
	}
	if len(tags) > 0 && p.t.life.Err() == nil {
		p.t.log.Warn("tcp: could not tell a receiver that transfers were aborted; it ends their receipts at its own deadline",
			"peer", p.addr, "aborted", len(tags), "patience", abortPatience)
	}
}

// writeAborts writes an ABORT for each of tags on a connection dialled for
// them within ctx, which it closes after: a connection of their own, so
// that they do not queue behind frames a stalled receiver has not read. It
// returns the tags not written, and why.
func (p *peer) writeAborts(ctx context.Context, tags []uint64) ([]uint64, error) {
	oc, err := p.dial(ctx, 0)
	if err != nil {
		return tags, err
	}
	defer oc.raw.Close()
	// A write that waits for room ends with ctx (Close), not only at its
	// deadline.
	stop := context.AfterFunc(ctx, func() { oc.raw.Close() })
	defer stop()
	for i, tag := range tags {
		if err := oc.writeAbort(ctx, tag); err != nil {
			return tags[i:], err
		}
	}
	return nil, nil
}

// conn returns the connection of slot i, dialling it when there is none.
func (p *peer) conn(ctx context.Context, i int) (*outConn, error) {
	now := time.Now()
	p.mu.Lock()
	oc := p.slots[i]
	var retired *outConn
	if oc != nil && p.t.retire > 0 && now.Sub(time.Unix(0, oc.used.Load())) >= p.t.retire {
		// Unused for 3/4 of the receiver's idle timeout: the receiver may
		// close it before a frame written now arrives. Dial anew.
		retired, oc, p.slots[i] = oc, nil, nil
	} else if oc != nil {
		oc.used.Store(now.UnixNano())
	}
	p.mu.Unlock()
	if retired != nil {
		retired.raw.Close() // its watch ends
	}
	if oc != nil {
		return oc, nil
	}
	oc, err := p.dial(ctx, i)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if cur := p.slots[i]; cur != nil { // a concurrent Send dialled it first
		p.mu.Unlock()
		oc.raw.Close()
		return cur, nil
	}
	p.slots[i] = oc
	// Safe against Close's Wait: dials happen only inside a Send, which
	// Close waits for before it waits for these goroutines.
	p.t.wg.Add(1)
	p.mu.Unlock()
	go oc.watch()
	return oc, nil
}

// dial opens a connection to the receiver for slot i within ctx: TCP, TLS
// when configured, the preface and the receiver's accept. The caller owns
// it (p.conn pools it).
func (p *peer) dial(ctx context.Context, i int) (*outConn, error) {
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	raw.(*net.TCPConn).SetNoDelay(true)
	oc := &outConn{p: p, slot: i, nc: raw, raw: raw, lock: make(chan struct{}, 1)}
	oc.used.Store(time.Now().UnixNano())
	if dl, ok := ctx.Deadline(); ok {
		raw.SetDeadline(dl)
	}
	if p.tls != nil {
		oc.batch = newBatchConn(raw)
		tc := tls.Client(oc.batch, p.tls)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, fmt.Errorf("TLS handshake with %s: %w", p.addr, err)
		}
		oc.nc, oc.tls = tc, true
	}
	var pre [prefaceLen]byte
	putPreface(pre[:], p.t.session)
	if _, err := oc.nc.Write(pre[:]); err != nil {
		raw.Close()
		return nil, err
	}
	if err := oc.accepted(ctx); err != nil {
		raw.Close()
		return nil, err
	}
	raw.SetDeadline(time.Time{})
	return oc, nil
}

// accepted waits, within ctx and prefaceTimeout, for the receiver's accept
// of a new connection (see wire.go): a receiver that refuses it, a TLS
// receiver that does not trust this sender's certificate above all, fails
// the dial here, before any frame is written.
func (oc *outConn) accepted(ctx context.Context) error {
	dl := time.Now().Add(prefaceTimeout)
	ctxDeadline := false
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl, ctxDeadline = d, true
	}
	oc.raw.SetReadDeadline(dl)
	stop := context.AfterFunc(ctx, func() { oc.raw.SetReadDeadline(time.Now()) })
	defer stop()
	var b [1]byte
	if _, err := io.ReadFull(oc.nc, b[:]); err != nil {
		var ne net.Error
		if ctxDeadline && errors.As(err, &ne) && ne.Timeout() {
			// The socket's deadline is ctx's: its timer may fire a moment
			// before ctx's own. The Send timed out; it was not refused.
			<-ctx.Done()
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		return fmt.Errorf("the receiver at %s refused the data connection: %w", oc.p.addr, err)
	}
	if b[0] != acceptByte {
		return fmt.Errorf("%w: the receiver at %s answered the preface with %#x, not its accept", transport.ErrProtocol, oc.p.addr, b[0])
	}
	return nil
}

// watch reads from the connection, which a receiver never writes to
// after its accept, so
// that a peer that closes or resets it is noticed at once: the connection
// is dropped from the pool and writes in progress on it fail.
func (oc *outConn) watch() {
	defer oc.p.t.wg.Done()
	var b [1]byte
	_, err := oc.nc.Read(b[:])
	if err == nil {
		err = fmt.Errorf("%w: receiver wrote on a data connection", transport.ErrProtocol)
	}
	var oe *net.OpError
	switch {
	case errors.Is(err, net.ErrClosed):
	case errors.As(err, &oe) && oe.Op == "remote error":
		// A TLS alert: the receiver refused this side's certificate.
		oc.p.t.log.Warn("tcp: the receiver refused the TLS data connection", "peer", oc.p.addr, "err", err)
	default:
		oc.p.t.log.Debug("tcp: outbound data connection ended", "peer", oc.p.addr, "err", err)
	}
	oc.p.drop(oc)
}

// drop closes oc and removes it from the pool.
func (p *peer) drop(oc *outConn) {
	p.mu.Lock()
	if p.slots[oc.slot] == oc {
		p.slots[oc.slot] = nil
	}
	p.mu.Unlock()
	oc.raw.Close()
}

// closeAll closes every pooled connection.
func (p *peer) closeAll() {
	p.mu.Lock()
	conns := make([]*outConn, 0, len(p.slots))
	for i, oc := range p.slots {
		if oc != nil {
			conns = append(conns, oc)
			p.slots[i] = nil
		}
	}
	p.mu.Unlock()
	for _, oc := range conns {
		oc.raw.Close()
	}
}

// writeFrame writes frame k of op: one vectored write of the header and the
// pieces of src it covers.
func (oc *outConn) writeFrame(op *sendOp, k int64) error {
	select {
	case oc.lock <- struct{}{}:
	case <-op.ctx.Done():
		return context.Cause(op.ctx)
	}
	oc.mu.Lock()
	oc.owner = op
	oc.mu.Unlock()
	if op.ctx.Err() != nil { // ended before interrupt could see us as owner
		oc.unlock()
		return context.Cause(op.ctx)
	}
	off := k * op.frame
	n := min(op.frame, op.total-off)
	putHeader(oc.hdr[:], frameHeader{typ: frameData, length: uint32(n), tag: op.tag, offset: uint64(off)})
	oc.vec = op.src.Append(append(oc.vec[:0], oc.hdr[:]), off, n)
	if pad := padLen(n); pad > 0 {
		oc.vec = append(oc.vec, zeros[:pad])
	}
	oc.bufs = oc.vec
	// One writev on a TCP connection. Over TLS, net.Buffers falls back to
	// a Write per piece (crypto/tls has no vectored write), each sealed
	// into records of at most 16 KiB, which batch gathers into larger
	// writes.
	if oc.batch != nil {
		oc.batch.begin()
	}
	w, err := oc.bufs.WriteTo(oc.nc)
	if oc.batch != nil {
		if ferr := oc.batch.end(); err == nil {
			err = ferr
		}
	}
	clear(oc.vec) // do not keep src reachable
	oc.used.Store(time.Now().UnixNano())
	if err != nil && (w > 0 || oc.tls || !errors.Is(err, os.ErrDeadlineExceeded)) {
		oc.p.drop(oc) // a partial frame: the stream is corrupt
	}
	oc.unlock()
	return err
}

// writeAbort writes an ABORT frame for tag, within ctx's deadline.
func (oc *outConn) writeAbort(ctx context.Context, tag uint64) error {
	select {
	case oc.lock <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	if dl, ok := ctx.Deadline(); ok {
		oc.mu.Lock()
		oc.nc.SetWriteDeadline(dl)
		oc.deadline = true
		oc.mu.Unlock()
	}
	putHeader(oc.hdr[:], frameHeader{typ: frameAbort, tag: tag})
	w, err := oc.nc.Write(oc.hdr[:])
	if err != nil && (w > 0 || oc.tls || !errors.Is(err, os.ErrDeadlineExceeded)) {
		oc.p.drop(oc)
	}
	oc.unlock()
	return err
}

// unlock releases the write lock, clearing a write deadline set while it
// was held.
func (oc *outConn) unlock() {
	oc.mu.Lock()
	if oc.deadline {
		oc.nc.SetWriteDeadline(time.Time{})
		oc.deadline = false
	}
	oc.owner = nil
	oc.mu.Unlock()
	<-oc.lock
}
