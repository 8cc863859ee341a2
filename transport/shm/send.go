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
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/memfd"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// errAnswered: the receiver answered an op before its last part was sent
// (an ERR: the receipt is unknown, busy, cancelled...).
var errAnswered = errors.New("shm: send: answered early")

// errRetired ends a pooled connection that was unused for 3/4 of the idle
// timeout (see outConn.retireIfUnused).
var errRetired = errors.New("shm: send: connection retired after 3/4 of the idle timeout unused")

// Window geometry: a sender copies each part of a Send into one slot of
// its window on the connection, which the receiver maps read-only.
const (
	// defaultMaxSlotLen caps a slot; smaller Options.FrameBytes make smaller
	// slots.
	defaultMaxSlotLen = 1 << 20
	// defaultWindowSlots is the number of slots of a window: parts in flight on a
	// connection. 8 slots of 1 MiB keep the window in a shared cache.
	defaultWindowSlots = 8
)

// sendOp is one Send in flight, for Close to cancel.
type sendOp struct{ ep string }

// outConn is the pooled connection to one receiver endpoint, with a reader
// goroutine that routes the receiver's answers to the Sends waiting and
// frees the window slots the receiver releases.
type outConn struct {
	t    *Transport
	ep   string
	nc   *net.UnixConn
	mr   *msgReader    // the reader goroutine's
	dead chan struct{} // closed when the reader has stopped
	// wlock is the write lock, so that messages are not interleaved. A
	// channel, so that waiting for it can end with ctx.
	wlock chan struct{}
	wbuf  []byte // guarded by wlock

	// The window: memory this connection's receiver can read and nobody
	// else can, holding only bytes Sends to that receiver copied there.
	// Copies into it hold winMu for reading; the reader goroutine unmaps
	// it, holding winMu, when the connection ends.
	winMu   sync.RWMutex
	win     *memfd.Mapping // nil once unmapped
	winMem  []byte
	slotLen int
	slots   int
	// count is the ring's count of parts posted, in the window; written
	// under mu (and winMu for reading), read by the reader goroutine.
	count *atomic.Uint64
	// idle is set when the receiver said IDLE and no POST has answered it
	// yet: whoever clears it writes the POST.
	idle atomic.Bool
	// used is when the pool last handed the connection out or an op on it
	// was answered (time since Transport.epoch): conn retires it once it
	// has been unused for Transport.retire.
	used atomic.Int64

	mu       sync.Mutex
	err      error // why it died; set before dead closes
	pending  map[uint64]*pendingOp
	nextOp   uint64
	credit   int64
	creditCh chan struct{} // closed when credit is returned; nil: no waiter
	posted   uint64        // parts posted in the ring
	free     []int         // slots not in use
	slotSt   []byte        // slotFree, slotTaken or slotSent
	slotSeq  []uint64      // of a slotSent slot: its part's index in the ring
	slotCh   chan struct{} // closed when a slot is freed; nil: no waiter
}

// pendingOp is an op waiting for its answer.
type pendingOp struct {
	id     uint64
	weight int64
	res    chan msg // the answer (DONE, ERR or PROBEOK); capacity 1
	early  msg      // an answer takeSlot took from res
	// last is the ring index of the op's last part once it is posted
	// (lastPosted), and lastSlot that part's slot: giveUp marks its entry.
	// Set by post, read by giveUp, under outConn.mu.
	last       uint64
	lastSlot   int
	lastPosted bool
}

func newOutConn(t *Transport, ep string, nc *net.UnixConn, mr *msgReader, win *memfd.Mapping, slotLen int) *outConn {
	oc := &outConn{
		t: t, ep: ep, nc: nc, mr: mr,
		dead:    make(chan struct{}),
		wlock:   make(chan struct{}, 1),
		win:     win,
		winMem:  win.Bytes(),
		slotLen: slotLen,
		slots:   windowSlots,
		count:   (*atomic.Uint64)(unsafe.Pointer(&win.Bytes()[windowSlots*slotLen])),
		pending: make(map[uint64]*pendingOp),
		nextOp:  1,
		credit:  t.credit,
		slotSt:  make([]byte, windowSlots),
		slotSeq: make([]uint64, windowSlots),
	}
	for s := range windowSlots {
		oc.free = append(oc.free, s)
	}
	oc.stamp(t.now())
	return oc
}

// now is the time since t opened, on the monotonic clock: what outConn.used
// holds.
func (t *Transport) now() time.Duration { return time.Since(t.epoch) }

// stamp notes that the connection is in use at now (see used).
func (oc *outConn) stamp(now time.Duration) { oc.used.Store(int64(now)) }

// retireIfUnused takes the connection out of use if it has been unused
// for t.retire and no op is open on it: the receiver, which closes a
// connection that made no progress for its idle timeout, may be about to
// close it, and a part posted now would be lost with it. It reports
// whether it did; the caller, holding t.mu, takes it out of the pool and
// closes it (closeRetired). An op that got the connection from the pool
// just before fails to start on it (errRetired) and asks for another.
func (oc *outConn) retireIfUnused(now time.Duration) bool {
	t := oc.t
	if t.retire <= 0 || now-time.Duration(oc.used.Load()) < t.retire {
		return false
	}
	oc.mu.Lock()
	defer oc.mu.Unlock()
	if oc.err != nil || len(oc.pending) > 0 {
		return false
	}
	oc.err = errRetired
	return true
}

// closeRetired ends a retired connection cleanly: the receiver reads its
// end (EOF) between two messages and closes its side, which ends the
// reader goroutine here; a receiver that does not close it within the
// grace period has it closed under it.
func (oc *outConn) closeRetired() {
	oc.nc.CloseWrite()
	oc.nc.SetReadDeadline(time.Now().Add(grace))
}

// Send copies src, part by part, into this transport's window on the
// connection to the receiver in desc, and the receiver copies each part
// out of it into its receipt. src can be any memory: it is read only by
// Send itself, and the receiver never sees anything but the parts of its
// own Sends (see the package documentation). Send returns nil once the
// receiver has copied every byte (and completed the receipt) and said so.
// src is not used after Send returns.
//
// When ctx ends first, Send tells the receiver to stop (CANCEL; ABORT when
// no part had gone out, delivered after Send returns, for up to
// abortPatience, when no connection took it within a second) and waits for
// the receiver to confirm that it stopped, for at most a second; the
// receipt fails with
// transport.ErrAborted, and Send returns an error wrapping ctx.Err() (a
// *transport.TimeoutError for a deadline), or nil if the receiver had copied
// everything first. A receiver that does not confirm in time has the
// connection closed (its receipt fails then, unless the receiver had
// completed it as it wrote a DONE that Send did not read in time). Close
// of the Transport does the same, and Send returns a
// *transport.ClosedError.
//
// A receiver that refuses or stops the transfer (no armed receipt for the
// tag, Cancel on its side) fails Send with ErrRefused (and
// transport.ErrCanceled for a cancel); a receipt of another length, with
// transport.ErrBadDescriptor; a peer that is gone or closing, with
// transport.ErrPeerLost.
func (t *Transport) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	d, err := descFormat.Decode(desc)
	if err != nil {
		return err
	}
	var total int64
	for _, b := range src {
		total += int64(len(b))
	}
	if total != d.Total {
		return descFormat.Bad("the receipt is for %d bytes, src has %d", d.Total, total)
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	op := &sendOp{ep: d.Endpoint}
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
	return t.send(ctx, sctx, d, src)
}

// cursor walks the pieces of a Send's source.
type cursor struct {
	src [][]byte
	i   int // piece
	off int // offset in it
}

// send runs a Send once its descriptor is checked.
func (t *Transport) send(ctx, sctx context.Context, d receipt.Descriptor, src [][]byte) error {
	ended := func() error { // ctx ended before the first part was posted
		var ce *transport.ClosedError
		if !t.abort(d.Endpoint, d.Tag) && !errors.As(context.Cause(sctx), &ce) {
			t.abortLater(d.Endpoint, d.Tag)
		}
		return ctxErr(ctx, sctx, d.Endpoint)
	}
	if sctx.Err() != nil {
		return ended()
	}
	var oc *outConn
	var p *pendingOp
	for p == nil {
		var err error
		oc, err = t.conn(sctx, d.Endpoint)
		if err != nil {
			if sctx.Err() != nil {
				return ended()
			}
			return peerLost("send to", d.Endpoint, err)
		}
		p, err = oc.acquire(sctx, 1)
		switch {
		case errors.Is(err, errRetired): // retired as it was handed out
		case err != nil && sctx.Err() != nil:
			return ended()
		case err != nil:
			return oc.lost(err)
		}
	}
	cur := cursor{src: src}
	var off int64
	for off < d.Total {
		slot, err := oc.takeSlot(sctx, p)
		if errors.Is(err, errAnswered) {
			oc.endOp(p.id) // so that the receiver forgets the op
			return oc.answer(p, p.early, false)
		}
		if err == nil && sctx.Err() != nil {
			oc.putSlot(slot)
			err = context.Cause(sctx)
		}
		if err == nil {
			k := int(min(int64(oc.slotLen), d.Total-off))
			m := msg{typ: msgRead, op: p.id, tag: d.Tag, total: uint64(d.Total), offset: uint64(off), slot: uint32(slot), length: uint32(k), last: off+int64(k) == d.Total}
			if !oc.post(p, &m, &cur) {
				return oc.lost(oc.deadErr())
			}
			off += int64(k)
			continue
		}
		switch {
		case sctx.Err() != nil && off == 0:
			oc.forget(p)
			return ended()
		case sctx.Err() != nil:
			return t.cancelOp(ctx, sctx, oc, p, d.Endpoint, false)
		}
		// A write fails because the connection died: say why it died (a
		// protocol error of the receiver's, say), not only that it is closed.
		return oc.lost(oc.deadErr())
	}
	select {
	case m := <-p.res:
		return oc.answer(p, m, true)
	case <-oc.dead:
		select {
		case m := <-p.res:
			return oc.answer(p, m, true)
		default:
		}
		return oc.lost(oc.deadErr())
	case <-sctx.Done():
	}
	return t.cancelOp(ctx, sctx, oc, p, d.Endpoint, true)
}

// cancelOp stops an op whose ctx ended after some of its parts went out:
// the receiver must confirm that it stopped.
func (t *Transport) cancelOp(ctx, sctx context.Context, oc *outConn, p *pendingOp, ep string, whole bool) error {
	gctx, gcancel := context.WithTimeout(context.Background(), grace)
	defer gcancel()
	oc.giveUp(p)
	if err := oc.writeMsg(gctx, oc.cancelMsg(p.id)); err != nil {
		oc.kill(fmt.Errorf("cancel not written within %v: %w", grace, err))
		return ctxErr(ctx, sctx, ep)
	}
	select {
	case m := <-p.res:
		if m.typ == msgDone && oc.answer(p, m, whole) == nil {
			return nil // every byte was copied before the cancel
		}
	case <-oc.dead:
	case <-gctx.Done():
		t.log.Warn("shm: receiver did not confirm a cancel; closing the connection", "peer", ep, "grace", grace)
		oc.kill(fmt.Errorf("the receiver did not confirm a cancel within %v", grace))
	}
	return ctxErr(ctx, sctx, ep)
}

// giveUp sets the gave-up word of the ring entry of p's last part, if it
// is posted and the receiver has not released it: a receiver that comes
// to that part now fails its receipt rather than completing it, however
// long it stalled before (wire.go). A released part was answered, and its
// entry may hold another op's part by now: it is left alone.
func (oc *outConn) giveUp(p *pendingOp) {
	oc.winMu.RLock()
	defer oc.winMu.RUnlock()
	if oc.winMem == nil {
		return // the connection ended, and the receipt with it
	}
	oc.mu.Lock()
	defer oc.mu.Unlock()
	oc.giveUpLocked(p)
}

// giveUpAll gives up on every op waiting for its answer, as the
// connection is closed under them (kill): their Sends fail, so their
// receipts must not complete in a receiver that reads on after a stall.
func (oc *outConn) giveUpAll() {
	oc.winMu.RLock()
	defer oc.winMu.RUnlock()
	if oc.winMem == nil {
		return
	}
	oc.mu.Lock()
	defer oc.mu.Unlock()
	for _, p := range oc.pending {
		oc.giveUpLocked(p)
	}
}

// giveUpLocked is giveUp with winMu held for reading (the window mapped)
// and mu held.
func (oc *outConn) giveUpLocked(p *pendingOp) {
	if !p.lastPosted {
		return // the receipt cannot complete without it
	}
	if oc.slotSt[p.lastSlot] != slotSent || oc.slotSeq[p.lastSlot] != p.last {
		return
	}
	at := oc.slots*oc.slotLen + ringHdr + int(p.last%uint64(oc.slots))*readLen + gaveUpAt
	(*atomic.Uint32)(unsafe.Pointer(&oc.winMem[at])).Store(gaveUpWord)
}

// gaveUpWord is the value whose bytes in memory are the big-endian 1 of
// a set gave-up word.
var gaveUpWord = binary.NativeEndian.Uint32([]byte{0, 0, 0, 1})

// endOp writes CANCEL for an op the receiver answered before its last part
// went out, so that the receiver can forget it.
func (oc *outConn) endOp(id uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := oc.writeMsg(ctx, oc.cancelMsg(id)); err != nil {
		oc.kill(fmt.Errorf("cancel not written within %v: %w", grace, err))
	}
}

// cancelMsg is the CANCEL of op: with the count of parts posted so far,
// which includes every part of op (only its own Send posts them, before).
func (oc *outConn) cancelMsg(op uint64) *msg {
	oc.mu.Lock()
	defer oc.mu.Unlock()
	return &msg{typ: msgCancel, op: op, seq: oc.posted}
}

// answer turns the receiver's answer to an op into Send's result. DONE is
// an answer only once every part has gone out (whole); the receipt
// completed as the receiver wrote it.
func (oc *outConn) answer(p *pendingOp, m msg, whole bool) error {
	switch {
	case m.typ == msgDone && whole:
		return nil
	case m.typ == msgErr:
		return refusal(oc.ep, m.code, m.text)
	}
	err := errProto("answer of type %d to an op with parts still to send", m.typ)
	if whole {
		err = errProto("answer of type %d to a read", m.typ)
	}
	oc.kill(err)
	return peerLost("send to", oc.ep, err)
}

// lost is Send's error once the connection died of err: ErrPeerLost, or
// the receiver's refusal of the window itself (ErrRefused).
func (oc *outConn) lost(err error) error {
	if errors.Is(err, ErrRefused) {
		return err
	}
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
// the Send for tag ended before it posted a part: the receipt fails with
// ErrAborted. It reports whether a connection took the ABORT.
func (t *Transport) abort(ep string, tag uint64) bool {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	oc, err := t.conn(ctx, ep)
	if err != nil {
		return false
	}
	if err := oc.writeMsg(ctx, &msg{typ: msgAbort, tag: tag}); err != nil {
		oc.kill(fmt.Errorf("abort not written within %v: %w", grace, err))
		return false
	}
	return true
}

// abortPatience bounds how long a Transport goes on trying to deliver the
// ABORT of a Send that could not deliver it within the grace: long enough
// for a receiver that stalled (a paused process, a swapping machine) to
// answer a dial again. The receipt's owner ends it at its own deadline if
// the ABORT never arrives.
const abortPatience = 30 * time.Second

// abortRetry is the pause between two tries to deliver late ABORTs to a
// receiver whose last dial failed for a reason that may pass.
const abortRetry = 100 * time.Millisecond

// abortLater leaves the ABORT for tag to deliverAborts, started unless it
// runs for ep. Called only inside a Send, whose count in t.sends keeps
// Close's Wait from passing before the goroutine is counted.
func (t *Transport) abortLater(ep string, tag uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tags, running := t.aborts[ep]
	t.aborts[ep] = append(tags, tag)
	if !running {
		t.sends.Add(1)
		go t.deliverAborts(ep)
	}
}

// deliverAborts writes the ABORTs left to it for ep on the pooled
// connection, dialling it as often as needed, until none is left. It gives
// up on those it has, and ends, at abortPatience, when the receiver cannot
// be reached for a reason that does not pass by waiting (no listener, a
// refused window: its receipts are gone with it), or when the Transport
// closes.
func (t *Transport) deliverAborts(ep string) {
	defer t.sends.Done()
	ctx, cancel := context.WithTimeout(t.life, abortPatience)
	defer cancel()
	var tags []uint64
	var err error
	for {
		t.mu.Lock()
		tags = append(tags, t.aborts[ep]...)
		t.aborts[ep] = t.aborts[ep][:0]
		if len(tags) == 0 || ctx.Err() != nil || receiverGone(err) {
			delete(t.aborts, ep)
			t.mu.Unlock()
			break
		}
		t.mu.Unlock()
		if tags, err = t.writeAborts(ctx, ep, tags); err != nil && !receiverGone(err) {
			select { // the receiver did not answer in time: again, shortly
			case <-ctx.Done():
			case <-time.After(abortRetry):
			}
		}
	}
	if len(tags) > 0 && t.life.Err() == nil {
		t.log.Warn("shm: could not tell a receiver that transfers were aborted; it ends their receipts at its own deadline",
			"peer", ep, "aborted", len(tags), "patience", abortPatience, "err", err)
	}
}

// receiverGone reports whether err, of a dial or a write, says that the
// receiver is not there to take an ABORT, and will not be: nothing listens
// at its endpoint, or it refused the window. A receiver that does not
// answer (stalled, its backlog full) may yet.
func receiverGone(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) || errors.Is(err, ErrRefused)
}

// writeAborts writes an ABORT for each of tags on the pooled connection to
// ep within ctx. It returns the tags not written, and why.
func (t *Transport) writeAborts(ctx context.Context, ep string, tags []uint64) ([]uint64, error) {
	oc, err := t.conn(ctx, ep)
	if err != nil {
		return tags, err
	}
	for i, tag := range tags {
		if err := oc.writeMsg(ctx, &msg{typ: msgAbort, tag: tag}); err != nil {
			err = fmt.Errorf("abort not written: %w", err)
			oc.kill(err)
			return tags[i:], err
		}
	}
	return nil, nil
}

// conn returns the pooled connection to ep, dialling it when there is
// none (one dial at a time per endpoint; the others wait for it).
func (t *Transport) conn(ctx context.Context, ep string) (*outConn, error) {
	for {
		t.mu.Lock()
		if oc := t.peers[ep]; oc != nil {
			now := t.now()
			if oc.retireIfUnused(now) {
				delete(t.peers, ep)
				t.mu.Unlock()
				oc.closeRetired()
				continue
			}
			oc.stamp(now)
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
		nc, mr, win, err := t.dialWindow(ctx, ep)
		t.mu.Lock()
		delete(t.dialing, ep)
		close(ch)
		if err != nil {
			t.mu.Unlock()
			return nil, err
		}
		oc := newOutConn(t, ep, nc, mr, win, t.slotLen)
		t.peers[ep] = oc
		// Safe against Close's Wait: dials happen only inside Sends and
		// Probes, which Close waits for before it waits for these.
		t.wg.Add(1)
		t.mu.Unlock()
		go oc.readLoop()
		return oc, nil
	}
}

// dialWindow dials ep and announces a fresh window to it: a memory file
// of windowSlots slots that this process maps writable and seals against
// every other write, so that the receiver can map it read-only and nothing
// else.
func (t *Transport) dialWindow(ctx context.Context, ep string) (*net.UnixConn, *msgReader, *memfd.Mapping, error) {
	nc, mr, err := dialUnix(ctx, ep, helloTimeout)
	if err != nil {
		return nil, nil, nil, explainDial(err)
	}
	win, err := memfd.New("kvxfer-shm-window", windowSlots*t.slotLen+ringLen(windowSlots), memfd.Options{PeerReadOnly: true})
	if err == nil {
		if err = sendWindow(nc, win, t.slotLen, windowSlots); err == nil {
			return nc, mr, win, nil
		}
		win.Close()
	}
	mr.closeFds()
	nc.Close()
	return nil, nil, nil, fmt.Errorf("announcing the window: %w", err)
}

// sendWindow writes a WINDOW message with win's memory file attached.
func sendWindow(nc *net.UnixConn, win *memfd.Mapping, slotLen, slots int) error {
	rc, err := win.File().SyscallConn()
	if err != nil {
		return err
	}
	b := appendMsg(nil, &msg{typ: msgWindow, slotLen: uint32(slotLen), slots: uint32(slots)})
	var werr error
	if err := rc.Control(func(fd uintptr) { werr = writeFull(nc, b, syscall.UnixRights(int(fd))) }); err != nil {
		return err
	}
	return werr
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
		switch m.typ {
		case msgRelease:
			err = oc.onRelease(m.slot)
		case msgIdle:
			err = oc.onIdle(m.seq)
		case msgErr, msgDone:
			if m.typ == msgErr && m.op == 0 {
				err = fmt.Errorf("%w (the receiver cannot map the window)", refusal(oc.ep, m.code, m.text))
				break
			}
			oc.mu.Lock()
			p := oc.pending[m.op]
			if p != nil {
				delete(oc.pending, m.op)
				oc.returnCredit(p.weight)
			}
			oc.mu.Unlock()
			oc.stamp(oc.t.now())
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
	oc.winMu.Lock()
	oc.win.Close()
	oc.win, oc.winMem = nil, nil
	oc.winMu.Unlock()
}

// States of a window slot on the sending side.
const (
	slotFree  = iota
	slotTaken // a Send fills it; its part is not posted yet
	slotSent  // its part is posted; the receiver releases it
)

// onRelease frees a slot the receiver has handled. Only a slot whose part
// was posted can be released: a receiver cannot have a slot refilled while a
// Send still fills it.
func (oc *outConn) onRelease(slot uint32) error {
	oc.mu.Lock()
	defer oc.mu.Unlock()
	if int(slot) >= len(oc.slotSt) || oc.slotSt[slot] != slotSent {
		return errProto("release of slot %d, which holds no part", slot)
	}
	oc.putSlotLocked(int(slot))
	return nil
}

// takeSlot waits for a free slot of the window, and takes it. It fails
// with errAnswered (the answer in p.early) when the receiver has answered
// p meanwhile.
func (oc *outConn) takeSlot(ctx context.Context, p *pendingOp) (int, error) {
	for {
		select {
		case m := <-p.res:
			p.early = m
			return -1, errAnswered
		default:
		}
		oc.mu.Lock()
		if oc.err != nil {
			err := oc.err
			oc.mu.Unlock()
			return -1, err
		}
		if len(oc.free) > 0 {
			// The slot freed first: the receiver's reading of it is the
			// furthest behind, so its lines are the least likely to sit
			// in the receiver's own cache, from where each store would
			// have to take them back. (In a model of the window without
			// protocol, two goroutines on this repository's 2-core test
			// machine, taking the slot freed last moved 13.1 GB/s, in
			// turn 14.0-14.5.)
			s := oc.free[0]
			oc.free = append(oc.free[:0], oc.free[1:]...)
			oc.slotSt[s] = slotTaken
			oc.mu.Unlock()
			return s, nil
		}
		if oc.slotCh == nil {
			oc.slotCh = make(chan struct{})
		}
		ch := oc.slotCh
		oc.mu.Unlock()
		select {
		case <-ch:
		case m := <-p.res:
			p.early = m
			return -1, errAnswered
		case <-oc.dead:
		case <-ctx.Done():
			return -1, context.Cause(ctx)
		}
	}
}

// putSlot frees a slot that was taken but not written.
func (oc *outConn) putSlot(s int) {
	oc.mu.Lock()
	oc.putSlotLocked(s)
	oc.mu.Unlock()
}

func (oc *outConn) putSlotLocked(s int) {
	oc.slotSt[s] = slotFree
	oc.free = append(oc.free, s)
	if oc.slotCh != nil {
		close(oc.slotCh)
		oc.slotCh = nil
	}
}

// fillChunk bounds each copy into the window. Go's copy switches to
// non-temporal stores at 1 MiB (runtime memmove on amd64), which write
// around the caches: a slot filled by one copy of 1 MiB would go to memory
// and the receiver would read it back from there, so the window would
// cost two more passes over memory per byte. Copies below that bound leave
// the slot in this core's cache and the shared one, where the receiver's
// copy finds it.
const fillChunk = 512 << 10

// post copies the next m.length bytes of cur into the slot m.slot, and
// posts the part m of p in the ring: its entry, then the count. It reports
// false when the window is gone (the connection ended). A receiver that
// said IDLE is woken with a POST.
func (oc *outConn) post(p *pendingOp, m *msg, cur *cursor) bool {
	oc.winMu.RLock()
	if oc.winMem == nil {
		oc.winMu.RUnlock()
		return false
	}
	fillSlot(oc.winMem[int(m.slot)*oc.slotLen:int(m.slot)*oc.slotLen+int(m.length)], cur)
	ring := oc.winMem[oc.slots*oc.slotLen:]
	oc.mu.Lock()
	n := oc.posted
	at := ringHdr + int(n%uint64(oc.slots))*readLen
	appendEntry(ring[at:at:at+readLen], m)
	oc.slotSt[m.slot], oc.slotSeq[m.slot] = slotSent, n
	if m.last {
		p.last, p.lastSlot, p.lastPosted = n, int(m.slot), true
	}
	oc.posted = n + 1
	oc.count.Store(n + 1)
	oc.mu.Unlock()
	oc.winMu.RUnlock()
	oc.wake(n + 1)
	return true
}

// onIdle notes that the receiver has taken seq parts from the ring and
// sleeps. It is woken at once if more were posted meanwhile, or else by
// the next post (the count is stored before idle is tested there, idle
// before the count here: one of the two sees the other). Only the reader
// goroutine calls it, while the window is mapped.
func (oc *outConn) onIdle(seq uint64) error {
	if n := oc.count.Load(); seq > n {
		return errProto("idle after %d parts, of %d posted", seq, n)
	}
	oc.idle.Store(true)
	if n := oc.count.Load(); n > seq {
		oc.wake(n)
	}
	return nil
}

// wake writes a POST (with n, the count of parts posted) if the receiver
// said IDLE since the last one.
func (oc *outConn) wake(n uint64) {
	if !oc.idle.CompareAndSwap(true, false) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := oc.writeMsg(ctx, &msg{typ: msgPost, seq: n}); err != nil {
		oc.kill(fmt.Errorf("post not written within %v: %w", grace, err))
	}
}

// fillSlot copies the next len(dst) bytes of cur into dst, a slot, fillChunk
// at most at a time.
func fillSlot(dst []byte, cur *cursor) {
	for len(dst) > 0 {
		for cur.off == len(cur.src[cur.i]) {
			cur.i, cur.off = cur.i+1, 0
		}
		n := copy(dst[:min(len(dst), fillChunk)], cur.src[cur.i][cur.off:])
		cur.off += n
		dst = dst[n:]
	}
}

// kill closes the connection (its reader then ends) and takes it out of
// the pool at once. The ops waiting for answers on it are given up first
// (giveUpAll). Neither mu nor winMu may be held.
func (oc *outConn) kill(err error) {
	oc.giveUpAll() // before the receiver can see the end
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

// forget drops an op that never posted a part, returning its credit.
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

	a, err := memfd.New("kvxfer-shm-probe", 4096+ringLen(1), memfd.Options{PeerReadOnly: true})
	if err != nil {
		return fmt.Errorf("shm: probe %s: cannot create shared memory here: %w", endpoint, err)
	}
	defer a.Close()
	nonce := receipt.Rand64()
	binary.BigEndian.PutUint64(a.Bytes(), nonce)
	const op = 1
	if err := sendWindow(nc, a, 4096, 1); err != nil {
		return fmt.Errorf("shm: probe %s: sending a memory file: %w", endpoint, err)
	}
	if err := writeFull(nc, appendMsg(nil, &msg{typ: msgProbe, op: op}), nil); err != nil {
		return fmt.Errorf("shm: probe %s: %w", endpoint, err)
	}
	m, err := mr.next()
	for err == nil && m.typ == msgIdle { // the receiver's worker found no part
		m, err = mr.next()
	}
	switch {
	case err != nil && ctx.Err() != nil:
		return fmt.Errorf("shm: probe %s: no answer: %w", endpoint, ctx.Err())
	case err != nil:
		return fmt.Errorf("shm: probe %s: %w", endpoint, err)
	case m.typ == msgErr && (m.op == op || m.op == 0):
		return fmt.Errorf("shm: probe %s: the peer cannot use memory shared from here: %q", endpoint, m.text)
	case m.typ != msgProbeOK || m.op != op:
		return fmt.Errorf("shm: probe %s: %w", endpoint, errProto("answer of type %d to a probe", m.typ))
	case m.nonce != nonce:
		return fmt.Errorf("shm: probe %s: the peer read %#x from the shared memory, not the %#x written here: not the same memory", endpoint, m.nonce, nonce)
	}
	return nil
}

// The window geometry in use; variables only so that benchmarks can try
// others.
var (
	maxSlotLen  = defaultMaxSlotLen
	windowSlots = defaultWindowSlots
)
