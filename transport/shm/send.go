//go:build linux

package shm

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transport"
)

// errNotWritten: a Send ended before its READ went out.
var errNotWritten = errors.New("shm: send: read not written")

// sendOp is one Send in flight, for Close to cancel.
type sendOp struct{ ep string }

// outConn is the pooled connection to one receiver endpoint, with a reader
// goroutine that routes the receiver's answers to the Sends waiting.
type outConn struct {
	t    *Transport
	ep   string
	nc   *net.UnixConn
	mr   *msgReader    // the reader goroutine's
	dead chan struct{} // closed when the reader has stopped
	// wlock is the write lock, held for all the messages of one op so that
	// a REGION precedes the READ that needs it and READ parts are not
	// interleaved. A channel, so that waiting for it can end with ctx.
	wlock chan struct{}

	// Guarded by wlock.
	announced map[uint32]bool
	wbuf      []byte
	segs      []segment

	mu       sync.Mutex
	err      error // why it died; set before dead closes
	pending  map[uint64]*pendingOp
	nextOp   uint64
	credit   int64
	creditCh chan struct{} // closed when credit is returned; nil: no waiter
}

// pendingOp is an op waiting for its answer.
type pendingOp struct {
	id     uint64
	weight int64
	res    chan msg // the answer (DONE, ERR or PROBEOK); capacity 1
}

func newOutConn(t *Transport, ep string, nc *net.UnixConn, mr *msgReader) *outConn {
	return &outConn{
		t: t, ep: ep, nc: nc, mr: mr,
		dead:      make(chan struct{}),
		wlock:     make(chan struct{}, 1),
		announced: make(map[uint32]bool),
		pending:   make(map[uint64]*pendingOp),
		nextOp:    1,
		credit:    t.credit,
	}
}

// Send has the receiver in desc copy src straight out of this process's
// memory: every non-empty piece of src must lie in a region registered with
// RegisterMemory with its memory file (else ErrNotShared). Send announces
// the regions the receiver has not seen yet (passing their memory files),
// writes a READ listing the pieces, and waits for the receiver's answer: it
// returns nil once the receiver has copied every byte (and Send has
// acknowledged that, which completes the receipt), after which src may be
// reused. src is only read, and only by the receiver.
//
// When ctx ends first, Send tells the receiver to stop (CANCEL; ABORT when
// its READ had not gone out) and waits for the receiver to confirm that it
// no longer reads src, for at most a second; the receipt fails with
// transport.ErrAborted, and Send returns an error wrapping ctx.Err() (a
// *transport.TimeoutError for a deadline), or nil if the receiver had copied
// everything first. A receiver that does not confirm in time has the
// connection closed: it may still read src for a moment, but cannot
// complete its receipt any more, for that needs the ACK. Close of the
// Transport does the same, and Send returns a *transport.ClosedError.
//
// A receiver that refuses or stops the transfer (no armed receipt for the
// tag, Cancel on its side) fails Send with ErrRefused (and
// transport.ErrCanceled for a cancel); a receipt of another length, with
// transport.ErrBadDescriptor; a peer that is gone or closing, with
// transport.ErrPeerLost.
func (t *Transport) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	d, err := decodeDescriptor(desc)
	if err != nil {
		return err
	}
	var total int64
	for _, b := range src {
		total += int64(len(b))
	}
	if total != d.total {
		return errDesc("the receipt is for %d bytes, src has %d", d.total, total)
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	op := &sendOp{ep: d.endpoint}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return &transport.ClosedError{Op: "send"}
	}
	t.ops[op] = cancel
	t.sends.Add(1)
	t.mu.Unlock()
	defer func() {
		t.mu.Lock()
		delete(t.ops, op)
		t.mu.Unlock()
		t.sends.Done()
	}()
	spans, err := t.resolve(src)
	if err != nil {
		return err
	}
	return t.send(ctx, sctx, d, spans)
}

// send runs a Send once its source is resolved.
func (t *Transport) send(ctx, sctx context.Context, d descriptor, spans []span) error {
	ended := func() error { // ctx ended before the READ went out
		t.abort(d.endpoint, d.tag)
		return ctxErr(ctx, sctx, d.endpoint)
	}
	if sctx.Err() != nil {
		return ended()
	}
	w := opWeight + int64(len(spans))
	if w > t.credit {
		return fmt.Errorf("shm: send: %d separate pieces, more than a connection's credit allows (%d)", len(spans), t.credit-opWeight)
	}
	oc, err := t.conn(sctx, d.endpoint)
	if err != nil {
		if sctx.Err() != nil {
			return ended()
		}
		return peerLost("send to", d.endpoint, err)
	}
	p, err := oc.acquire(sctx, w)
	if err != nil {
		if sctx.Err() != nil {
			return ended()
		}
		return peerLost("send to", d.endpoint, err)
	}
	if err := oc.writeRead(sctx, p.id, d.tag, spans); err != nil {
		if errors.Is(err, errNotWritten) {
			oc.forget(p)
			return ended()
		}
		if sctx.Err() != nil { // the write was cut short, the connection closed
			return ctxErr(ctx, sctx, d.endpoint)
		}
		return peerLost("send to", d.endpoint, err)
	}
	select {
	case m := <-p.res:
		return oc.answer(p, m)
	case <-oc.dead:
		select {
		case m := <-p.res:
			return oc.answer(p, m)
		default:
		}
		return peerLost("send to", d.endpoint, oc.deadErr())
	case <-sctx.Done():
	}

	// Cancel: the receiver must confirm that it stopped reading src.
	gctx, gcancel := context.WithTimeout(context.Background(), grace)
	defer gcancel()
	if err := oc.writeMsg(gctx, &msg{typ: msgCancel, op: p.id}); err != nil {
		oc.kill(fmt.Errorf("cancel not written within %v: %w", grace, err))
		return ctxErr(ctx, sctx, d.endpoint)
	}
	select {
	case m := <-p.res:
		if m.typ == msgDone && oc.answer(p, m) == nil {
			return nil // every byte was copied before the cancel
		}
	case <-oc.dead:
	case <-gctx.Done():
		t.log.Warn("shm: receiver did not confirm a cancel; closing the connection", "peer", d.endpoint, "grace", grace)
		oc.kill(fmt.Errorf("the receiver did not confirm a cancel within %v", grace))
	}
	return ctxErr(ctx, sctx, d.endpoint)
}

// answer turns the receiver's answer to a READ into Send's result. DONE is
// acknowledged first: only the ACK completes the receipt, and it is sent
// only while src is still untouched.
func (oc *outConn) answer(p *pendingOp, m msg) error {
	switch m.typ {
	case msgDone:
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		if err := oc.writeMsg(ctx, &msg{typ: msgAck, op: p.id}); err != nil {
			oc.kill(err)
			return peerLost("send to", oc.ep, fmt.Errorf("acknowledging: %w", err))
		}
		return nil
	case msgErr:
		return refusal(oc.ep, m.code, m.text)
	}
	err := errProto("answer of type %d to a read", m.typ)
	oc.kill(err)
	return peerLost("send to", oc.ep, err)
}

// refusal is Send's error for an ERR answer.
func refusal(ep string, code uint32, text string) error {
	switch code {
	case codeMismatch:
		return fmt.Errorf("shm: send to %s: %w: %q", ep, transport.ErrBadDescriptor, text)
	case codeCanceled:
		return fmt.Errorf("shm: send to %s: %w: %w: %q", ep, ErrRefused, transport.ErrCanceled, text)
	case codeClosing:
		return fmt.Errorf("shm: send to %s: %w: %q", ep, transport.ErrPeerLost, text)
	case codeAborted:
		return fmt.Errorf("shm: send to %s: %w: %q", ep, transport.ErrAborted, text)
	}
	return fmt.Errorf("shm: send to %s: %w (code %d): %q", ep, ErrRefused, code, text)
}

// ctxErr is Send's error once ctx (or Close, through sctx) ended it.
func ctxErr(ctx, sctx context.Context, ep string) error {
	switch cerr := ctx.Err(); {
	case errors.Is(cerr, context.DeadlineExceeded):
		return &transport.TimeoutError{Op: "send", Peer: ep, Err: cerr}
	case cerr != nil:
		return fmt.Errorf("shm: send to %s: %w", ep, cerr)
	}
	var ce *transport.ClosedError
	if cause := context.Cause(sctx); errors.As(cause, &ce) {
		return ce
	}
	return fmt.Errorf("shm: send to %s: %w", ep, context.Cause(sctx))
}

// abort tells the receiver, best effort and within the grace period, that
// the Send for tag ended before its READ: the receipt fails with
// ErrAborted.
func (t *Transport) abort(ep string, tag uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	oc, err := t.conn(ctx, ep)
	if err != nil {
		return
	}
	oc.writeMsg(ctx, &msg{typ: msgAbort, tag: tag}) // a failure kills oc
}

// conn returns the pooled connection to ep, dialling it when there is
// none (one dial at a time per endpoint; the others wait for it).
func (t *Transport) conn(ctx context.Context, ep string) (*outConn, error) {
	for {
		t.mu.Lock()
		if oc := t.peers[ep]; oc != nil {
			t.mu.Unlock()
			return oc, nil
		}
		if ch := t.dialing[ep]; ch != nil {
			t.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}
		ch := make(chan struct{})
		t.dialing[ep] = ch
		t.mu.Unlock()
		nc, mr, err := dialUnix(ctx, ep, helloTimeout)
		t.mu.Lock()
		delete(t.dialing, ep)
		close(ch)
		if err != nil {
			t.mu.Unlock()
			return nil, explainDial(err)
		}
		oc := newOutConn(t, ep, nc, mr)
		t.peers[ep] = oc
		// Safe against Close's Wait: dials happen only inside Sends and
		// Probes, which Close waits for before it waits for these.
		t.wg.Add(1)
		t.mu.Unlock()
		go oc.readLoop()
		return oc, nil
	}
}

// explainDial adds what a refused connection to an abstract socket means.
func explainDial(err error) error {
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("%w (no shm transport listens there in this host's network namespace)", err)
	}
	return err
}

// readLoop routes answers to the ops waiting for them until the connection
// ends or breaks the protocol.
func (oc *outConn) readLoop() {
	defer oc.t.wg.Done()
	var err error
	for err == nil {
		var m msg
		if m, err = oc.mr.next(); err != nil {
			break
		}
		if len(oc.mr.fds) > 0 {
			err = errProto("the receiver sent descriptors")
			break
		}
		switch m.typ {
		case msgDone, msgErr:
			oc.mu.Lock()
			p := oc.pending[m.op]
			if p != nil {
				delete(oc.pending, m.op)
				oc.returnCredit(p.weight)
			}
			oc.mu.Unlock()
			if p == nil {
				err = errProto("answer for op %d, which is not waiting", m.op)
				break
			}
			p.res <- m
		default:
			err = errProto("message type %d from a receiver", m.typ)
		}
	}
	switch {
	case errors.Is(err, transport.ErrProtocol):
		oc.t.log.Warn("shm: closing connection", "peer", oc.ep, "err", err)
	case errors.Is(err, io.EOF):
		err = errors.New("connection closed by the receiver")
	}
	oc.mu.Lock()
	if oc.err == nil {
		oc.err = err
	}
	oc.mu.Unlock()
	oc.drop()
	oc.nc.Close()
	oc.mr.closeFds()
	close(oc.dead)
}

// kill closes the connection (its reader then ends) and takes it out of
// the pool at once.
func (oc *outConn) kill(err error) {
	oc.mu.Lock()
	if oc.err == nil {
		oc.err = err
	}
	oc.mu.Unlock()
	oc.drop()
	oc.nc.Close()
}

// drop takes oc out of the pool, so that the next Send redials.
func (oc *outConn) drop() {
	t := oc.t
	t.mu.Lock()
	if t.peers[oc.ep] == oc {
		delete(t.peers, oc.ep)
	}
	t.mu.Unlock()
}

// deadErr returns why the connection died.
func (oc *outConn) deadErr() error {
	oc.mu.Lock()
	defer oc.mu.Unlock()
	if oc.err == nil {
		return errors.New("connection closed")
	}
	return oc.err
}

// acquire waits until the connection has credit for an op of weight w
// and registers a new op.
func (oc *outConn) acquire(ctx context.Context, w int64) (*pendingOp, error) {
	for {
		oc.mu.Lock()
		if oc.err != nil {
			err := oc.err
			oc.mu.Unlock()
			return nil, err
		}
		if oc.credit >= w {
			oc.credit -= w
			p := &pendingOp{id: oc.nextOp, weight: w, res: make(chan msg, 1)}
			oc.nextOp++
			oc.pending[p.id] = p
			oc.mu.Unlock()
			return p, nil
		}
		if oc.creditCh == nil {
			oc.creditCh = make(chan struct{})
		}
		ch := oc.creditCh
		oc.mu.Unlock()
		select {
		case <-ch:
		case <-oc.dead:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// forget drops an op whose READ was never written, returning its credit.
func (oc *outConn) forget(p *pendingOp) {
	oc.mu.Lock()
	if oc.pending[p.id] == p {
		delete(oc.pending, p.id)
		oc.returnCredit(p.weight)
	}
	oc.mu.Unlock()
}

// returnCredit gives back w and wakes the ops waiting for credit. oc.mu
// must be held.
func (oc *outConn) returnCredit(w int64) {
	oc.credit += w
	if oc.creditCh != nil {
		close(oc.creditCh)
		oc.creditCh = nil
	}
}

// lock takes the write lock, unless ctx ends or the connection dies first.
func (oc *outConn) lock(ctx context.Context) error {
	select {
	case oc.wlock <- struct{}{}:
		return nil
	case <-oc.dead:
		return oc.deadErr()
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (oc *outConn) unlock() { <-oc.wlock }

// writeRead writes the REGIONs the receiver has not seen yet and the READ
// parts of op id. It returns errNotWritten (wrapped) when ctx ended before
// anything was written. A write in progress when ctx ends gets the grace
// period; a failed write leaves the stream corrupt, so it kills the
// connection.
func (oc *outConn) writeRead(ctx context.Context, id, tag uint64, spans []span) error {
	if err := oc.lock(ctx); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%w: %w", errNotWritten, err)
		}
		return err
	}
	defer oc.unlock()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", errNotWritten, err)
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		oc.nc.SetWriteDeadline(time.Now().Add(grace))
	})
	defer func() {
		if !stop() {
			<-fired
			oc.nc.SetWriteDeadline(time.Time{})
		}
	}()

	for _, s := range spans {
		r := s.r
		if oc.announced[r.id] {
			continue
		}
		oc.wbuf = appendMsg(oc.wbuf[:0], &msg{typ: msgRegion, region: r.id, size: uint64(r.size)})
		if err := writeFull(oc.nc, oc.wbuf, syscall.UnixRights(r.fd)); err != nil {
			oc.kill(err)
			return err
		}
		oc.announced[r.id] = true
	}
	buf := oc.wbuf[:0]
	var off uint64
	for i := 0; i < len(spans); i += maxSegsPerMsg {
		part := spans[i:min(i+maxSegsPerMsg, len(spans))]
		segs := oc.segs[:0]
		start := off
		for _, s := range part {
			segs = append(segs, segment{region: s.r.id, offset: s.offset, length: s.length})
			off += s.length
		}
		oc.segs = segs
		buf = appendMsg(buf, &msg{typ: msgRead, op: id, tag: tag, offset: start, last: i+len(part) == len(spans), segs: segs})
	}
	if cap(buf) <= 1<<20 {
		oc.wbuf = buf
	} else {
		oc.wbuf = nil // rare: do not keep a large buffer
	}
	if _, err := oc.nc.Write(buf); err != nil {
		oc.kill(err)
		return err
	}
	return nil
}

// writeMsg writes one small message within ctx's deadline; a failure kills
// the connection.
func (oc *outConn) writeMsg(ctx context.Context, m *msg) error {
	if err := oc.lock(ctx); err != nil {
		return err
	}
	defer oc.unlock()
	if dl, ok := ctx.Deadline(); ok {
		oc.nc.SetWriteDeadline(dl)
		defer oc.nc.SetWriteDeadline(time.Time{})
	}
	oc.wbuf = appendMsg(oc.wbuf[:0], m)
	if _, err := oc.nc.Write(oc.wbuf); err != nil {
		oc.kill(err)
		return err
	}
	return nil
}

// Probe checks that this transport can Send to the shm transport at
// endpoint: it connects (possible only on the same host and in the same
// network namespace), shares a small sealed memory file with it, and has
// the peer map it and read back a random value written here. It moves no
// data of any request, uses a connection of its own, and leaves nothing
// behind. It fails within ctx, and within 5 s at most, with an error that
// says which step failed.
func (t *Transport) Probe(ctx context.Context, endpoint string) error {
	if err := checkEndpoint(endpoint); err != nil {
		return fmt.Errorf("shm: probe: %w", err)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return &transport.ClosedError{Op: "probe"}
	}
	t.sends.Add(1)
	t.mu.Unlock()
	defer t.sends.Done()

	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	nc, mr, err := dialUnix(ctx, endpoint, probeTimeout)
	if err != nil {
		return fmt.Errorf("shm: probe %s: %w", endpoint, explainDial(err))
	}
	defer nc.Close()
	defer mr.closeFds()
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		nc.SetDeadline(aLongTimeAgo)
	})
	defer func() {
		if !stop() {
			<-fired
		}
	}()

	a, err := kvcache.ShmAllocator{Name: "kvxfer-shm-probe"}.Allocate(4096)
	if err != nil {
		return fmt.Errorf("shm: probe %s: cannot create shared memory here: %w", endpoint, err)
	}
	defer a.Close()
	nonce := randUint64()
	binary.BigEndian.PutUint64(a.Bytes(), nonce)
	fd, err := dupMemFile(a.(*kvcache.ShmArena).File(), 4096)
	if err != nil {
		return fmt.Errorf("shm: probe %s: %w", endpoint, err)
	}
	defer closeFd(fd)
	const op, reg = 1, 1
	b := appendMsg(nil, &msg{typ: msgRegion, region: reg, size: 4096})
	if err := writeFull(nc, b, syscall.UnixRights(fd)); err != nil {
		return fmt.Errorf("shm: probe %s: sending a memory file: %w", endpoint, err)
	}
	if err := writeFull(nc, appendMsg(nil, &msg{typ: msgProbe, op: op, region: reg}), nil); err != nil {
		return fmt.Errorf("shm: probe %s: %w", endpoint, err)
	}
	m, err := mr.next()
	switch {
	case err != nil && ctx.Err() != nil:
		return fmt.Errorf("shm: probe %s: no answer: %w", endpoint, ctx.Err())
	case err != nil:
		return fmt.Errorf("shm: probe %s: %w", endpoint, err)
	case m.typ == msgErr && m.op == op:
		return fmt.Errorf("shm: probe %s: the peer cannot use memory shared from here: %q", endpoint, m.text)
	case m.typ != msgProbeOK || m.op != op:
		return fmt.Errorf("shm: probe %s: %w", endpoint, errProto("answer of type %d to a probe", m.typ))
	case m.nonce != nonce:
		return fmt.Errorf("shm: probe %s: the peer read %#x from the shared memory, not the %#x written here: not the same memory", endpoint, m.nonce, nonce)
	}
	return nil
}
