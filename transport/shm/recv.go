//go:build linux

package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/memfd"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/conn"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// maxMapped bounds the bytes of peers' windows one Transport maps at once
// (virtual address space; each window is a sender's memory). A window past
// it is refused (ERR, "cannot map") rather than let peers exhaust the
// address space of this process.
const maxMapped = 1 << 40

// errIdle ends an accepted connection that made no progress for the idle
// timeout (transport.Options.IdleTimeout): no message, no part taken from
// the ring, no write to the sender.
var errIdle = errors.New("shm: data connection idle")

// maxOpenOps bounds the ops a sender keeps open on one connection; a
// receiver allows twice as many (an op is forgotten on each side at
// slightly different moments).
const maxOpenOps = 1024

// spinFor is how long a worker that finds no part in the ring, while an op
// has parts to come, keeps looking before it says IDLE and sleeps until a
// POST: a sender in the middle of a Send posts its next part within the
// time of one slot's copy, and a wake-up through the socket costs more
// than that on a busy host.
const spinFor = 100 * time.Microsecond

// testHookPiece, when set, is called by the worker before every part it
// copies. Tests use it to hold a transfer in the middle.
var testHookPiece atomic.Pointer[func()]

// recv is one armed receipt; Fill is the op filling it, nil before its
// first part. The worker tests Ended between parts without the lock.
type recv = receipt.Recv[*rop]

// rop is one op, the receiving side of one Send. The reader creates it at
// its first part; the worker answers it.
type rop struct {
	id     uint64
	tag    uint64
	total  int64
	refuse uint32 // an ERR code decided at the first part; 0: none
	why    string
	r      *recv // the receipt it fills; nil when refused

	// Guarded by inConn.mu.
	next      int64 // offset of the next part (reader)
	wireEnded bool  // its last part or a CANCEL was read
	answered  bool  // DONE or ERR decided (the receipt ended)
	// cancelled is set by the sender's CANCEL; the worker tests it.
	cancelled atomic.Bool
}

// item is one entry of a connection's work queue: a part to copy, or a
// CANCEL to carry out, in the order they were read.
type item struct {
	op     *rop
	cancel bool
	last   bool
	offset int64 // of the part in the receipt
	slot   int
	length int
	seq    uint64 // the part's index in the ring (taken-count when pulled)
}

// inConn is an accepted connection: a reader goroutine (serve) that
// handles messages, and a worker goroutine (work) that takes the parts
// posted in the sender's ring and copies them, one at a time, in order,
// out of the sender's window.
//
// Lock order: workMu, then pullMu, then Transport.mu, then inConn.mu.
type inConn struct {
	t      *Transport
	nc     *net.UnixConn
	remote string
	mr     *msgReader // the reader's

	// The sender's window, mapped read-only; set once by the reader
	// before the first part that uses it, unmapped after the worker ends.
	win       *memfd.Mapping
	winMem    []byte
	winErr    error // why the window could not be mapped
	slotLen   int
	slots     int
	winMapped int64 // bytes counted in Transport.mapped

	dead   chan struct{} // closed when the reader stops
	isDead atomic.Bool
	wake   chan struct{} // the queue has grown, a POST came, or the window was mapped
	failed error         // why the worker closed the connection; set before it does, under mu

	// The ring, in the window: set by the reader under pullMu once the
	// window is mapped; taken is the count of parts taken from it.
	pullMu sync.Mutex
	ring   []byte
	count  *atomic.Uint64
	taken  uint64

	workerDone chan struct{}
	// workMu is held by whoever does the worker's job: the worker, but
	// for while it sleeps, when the reader may take it (onPost).
	workMu sync.Mutex

	wmu  sync.Mutex
	wbuf []byte // guarded by wmu

	mu    sync.Mutex
	ops   map[uint64]*rop // open: not both answered and ended on the wire
	queue []item
	held  []bool // held[slot]: a part in the slot is not released yet
	// pending holds the RELEASEs and answers of handled items that the
	// worker has not written yet, in order; urgent is set when they hold
	// an answer or half the window's slots (see work).
	pending []msg
	nrel    int
	urgent  bool
	// expecting counts the open ops whose last part is still to come:
	// while there are, the worker keeps looking at the ring (see work).
	expecting int

	out []msg // the messages flush writes; whoever holds workMu uses it

	// msgs counts the messages read after the window (reader only), wrote
	// the writes to the sender: with taken, the progress that keeps the
	// connection from being closed as idle (idleCheck).
	msgs  uint64
	wrote atomic.Uint64
}

func newInConn(t *Transport, nc *net.UnixConn) *inConn {
	mr := newMsgReader(nc)
	mr.want = 1 // the WINDOW's memory file
	return &inConn{
		t:          t,
		nc:         nc,
		remote:     peerName(nc),
		mr:         mr,
		dead:       make(chan struct{}),
		wake:       make(chan struct{}, 1),
		workerDone: make(chan struct{}),
		ops:        make(map[uint64]*rop),
	}
}

// Expect arms a receipt of sum(len(dst[i])) bytes under a fresh random tag.
// dst can be any memory; it need not be registered. Its Cancel ends the
// receipt with ErrCanceled unless it has ended, then waits until nothing
// copies into dst: a copy in progress stops before its next part (at most
// one window slot). The Send filling it, if any, fails with ErrRefused and
// transport.ErrCanceled, unless the receiver had already told it that every
// byte was copied.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	return t.receipts.Expect(dst)
}

// serve runs the reader of an accepted connection, then tears it down.
func (c *inConn) serve() {
	defer c.t.wg.Done()
	err := c.readLoop()
	c.mu.Lock()
	failed := c.failed
	c.mu.Unlock()
	switch {
	case failed != nil:
		err = failed // logged by fail
	case errors.Is(err, errIdle):
		c.t.log.Debug("shm: closed an idle data connection", "remote", c.remote, "idle_timeout", c.t.idle, "err", err)
	default:
		c.logEnd(err)
	}
	c.teardown(err)
}

// logEnd logs why the connection ended. A protocol error is logged at most
// once a second, with the count of those left out: any process of the host
// can connect and write junk, and must not buy a warning with each
// connection.
func (c *inConn) logEnd(err error) {
	if errors.Is(err, transport.ErrProtocol) {
		c.t.protoLog.Warn("protocol", "shm: closing connection", "remote", c.remote, "err", err)
		return
	}
	conn.LogEnd(c.t.log, "shm", "connection", c.remote, err)
}

// teardown closes the connection, stops the worker (closing first frees a
// worker blocked writing an answer), fails the receipts this connection
// was filling (ErrPeerLost), unmaps the sender's window once nothing
// copies out of it, and closes every descriptor received.
func (c *inConn) teardown(err error) {
	c.isDead.Store(true)
	close(c.dead)
	c.nc.Close()
	<-c.workerDone
	if errors.Is(err, io.EOF) {
		err = errors.New("connection closed by the sender")
	}
	lost := peerLost("receive from", c.remote, err)
	t := c.t
	t.mu.Lock()
	delete(t.inbound, c)
	c.mu.Lock()
	for _, op := range c.ops {
		if op.r != nil {
			op.r.FinishLocked(lost)
		}
	}
	c.ops, c.queue = nil, nil
	c.mu.Unlock()
	t.mu.Unlock()
	if c.win != nil {
		if err := c.win.Close(); err != nil {
			t.log.Warn("shm: unmapping a sender's window", "remote", c.remote, "err", err)
		}
		c.win, c.winMem = nil, nil
	}
	t.mapped.Add(-c.winMapped)
	c.mr.closeFds()
}

// readLoop reads the HELLO and then messages until the connection ends or
// breaks the protocol; it returns why.
func (c *inConn) readLoop() error {
	// Nobody waits on this connection yet, so a plain deadline bounds how
	// long a silent one is kept.
	c.nc.SetReadDeadline(time.Now().Add(helloTimeout))
	m, err := c.mr.next()
	if err != nil {
		return err
	}
	if err := checkHello(m); err != nil {
		return err
	}
	if err := c.write(msg{typ: msgHello, version: protoVersion}); err != nil {
		return err
	}
	// Every sender announces its window at once (a probe too): a
	// connection that does not is not kept.
	if m, err = c.mr.next(); err != nil {
		return err
	}
	if m.typ != msgWindow {
		return errProto("message type %d before the window", m.typ)
	}
	if err := c.onWindow(m); err != nil {
		return err
	}
	// From here, parts go through the ring and the socket may be silent
	// while they flow: the deadline checks progress (idleCheck).
	var seen uint64
	if c.t.idle > 0 {
		seen = c.progress()
		c.nc.SetReadDeadline(time.Now().Add(c.t.idle))
	} else {
		c.nc.SetReadDeadline(time.Time{})
	}
	for {
		m, err := c.mr.next()
		if err != nil {
			if c.t.idle > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
				if err = c.idleCheck(&seen); err == nil {
					continue // msgReader keeps what it read of a message
				}
			}
			return err
		}
		c.msgs++
		switch m.typ {
		case msgWindow:
			err = c.onWindow(m)
		case msgPost:
			c.onPost()
		case msgCancel:
			err = c.onCancel(m)
		case msgAbort:
			c.onAbort(m)
		case msgProbe:
			err = c.onProbe(m)
		default:
			err = errProto("message type %d from a sender", m.typ)
		}
		if err != nil {
			return err
		}
	}
}

// progress returns a count that grows whenever the connection moves: a
// message read from the sender, a part taken from the ring, a write to
// the sender (releases, answers, IDLE). Reader only.
func (c *inConn) progress() uint64 {
	c.pullMu.Lock()
	taken := c.taken
	c.pullMu.Unlock()
	return c.msgs + taken + c.wrote.Load()
}

// idleCheck runs when the read deadline, the idle timeout's, has passed:
// a connection that moved since the deadline was set (seen, its progress
// then) gets another idle timeout; one that did not is idle, or stalled
// inside an op or a message, and idleCheck returns why it is closed.
// Reader only.
func (c *inConn) idleCheck(seen *uint64) error {
	if now := c.progress(); now != *seen {
		*seen = now
		c.nc.SetReadDeadline(time.Now().Add(c.t.idle))
		return nil
	}
	c.mu.Lock()
	open := len(c.ops)
	c.mu.Unlock()
	switch partial := c.mr.w - c.mr.r; {
	case partial > 0:
		return fmt.Errorf("%w: stalled inside a message (%d bytes of it read), no progress for %v", errIdle, partial, c.t.idle)
	case open > 0:
		return fmt.Errorf("%w: %d ops open, no part, message or answer for %v", errIdle, open, c.t.idle)
	}
	return fmt.Errorf("%w: no part, message or answer for %v", errIdle, c.t.idle)
}

// onWindow maps the sender's window, read-only. A window that cannot be
// mapped is remembered with the reason, which the ops that read it get.
func (c *inConn) onWindow(m msg) error {
	fd, ok := c.mr.takeFd()
	if !ok {
		return errProto("window announced without its memory file")
	}
	if !memfd.IsShmem(fd) {
		closeReceived(fd)
		return errProto("window announced with a descriptor that is not shared memory (memfd)")
	}
	f := fdFile(fd, "shm sender window")
	defer f.Close() // the mapping does not need it
	if c.slots != 0 {
		return errProto("window announced twice")
	}
	c.slotLen, c.slots = int(m.slotLen), int(m.slots)
	c.held = make([]bool, c.slots)
	slots := int64(m.slotLen) * int64(m.slots)
	size := slots + int64(ringLen(c.slots))
	if c.t.mapped.Add(size) > maxMapped {
		c.t.mapped.Add(-size)
		c.winErr = fmt.Errorf("senders' windows mapped here would exceed %d bytes", int64(maxMapped))
		return c.refuseWindow()
	}
	a, err := memfd.MapReadOnly(f, size)
	if err != nil {
		c.t.mapped.Add(-size)
		c.t.log.Warn("shm: cannot map a sender's window", "remote", c.remote, "size", size, "err", err)
		c.winErr = err
		return c.refuseWindow()
	}
	c.win, c.winMem, c.winMapped = a, a.Bytes(), size
	c.pullMu.Lock()
	c.ring = c.winMem[slots:]
	c.count = (*atomic.Uint64)(unsafe.Pointer(&c.ring[0]))
	c.pullMu.Unlock()
	c.signal() // the worker looks at the ring
	return nil
}

// refuseWindow tells the sender that its window cannot be mapped (ERR for
// op 0): no part of it will be taken.
func (c *inConn) refuseWindow() error {
	return c.write(msg{typ: msgErr, code: codeRegion, text: fmt.Sprintf("cannot map the sender's window: %v", c.winErr)})
}

// pull takes the parts posted in the ring since the last pull and queues
// them (onRead), in order; it reports false while no window is mapped.
// The worker calls it, and the reader before it handles a CANCEL.
func (c *inConn) pull() (bool, error) {
	c.pullMu.Lock()
	defer c.pullMu.Unlock()
	if c.count == nil {
		return false, nil
	}
	n := c.count.Load()
	if n < c.taken || n-c.taken > uint64(c.slots) {
		return true, errProto("the ring's count of parts went from %d to %d, with %d slots", c.taken, n, c.slots)
	}
	for ; c.taken < n; c.taken++ {
		// Copied out before it is checked: the sender can write the
		// ring at any time.
		var e [readLen]byte
		at := ringHdr + int(c.taken%uint64(c.slots))*readLen
		copy(e[:], c.ring[at:at+readLen])
		m, err := decodeEntry(e[:])
		if err == nil {
			err = c.onRead(m, c.taken)
		}
		if err != nil {
			return true, fmt.Errorf("part %d of the ring: %w", c.taken, err)
		}
	}
	return true, nil
}

// onRead checks a part taken from the ring and queues it for the worker. Its first part
// creates the op and binds it to the receipt of its tag, or records why
// not (the worker then answers ERR).
func (c *inConn) onRead(m msg, seq uint64) error {
	if c.slots == 0 {
		return errProto("read before the window was announced")
	}
	if int(m.slot) >= c.slots || int(m.length) > c.slotLen {
		return errProto("read part in slot %d of %d bytes; the window has %d slots of %d", m.slot, m.length, c.slots, c.slotLen)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held[m.slot] {
		return errProto("read part in slot %d, which holds a part not released yet", m.slot)
	}
	op := c.ops[m.op]
	switch {
	case m.offset == 0 && op != nil:
		return errProto("op %d started twice", m.op)
	case m.offset != 0 && (op == nil || op.wireEnded || op.tag != m.tag || uint64(op.total) != m.total || uint64(op.next) != m.offset):
		return errProto("read part of op %d at offset %d out of sequence", m.op, m.offset)
	case op == nil && len(c.ops) >= 2*maxOpenOps:
		return errProto("more than %d ops open on one connection", 2*maxOpenOps)
	}
	if op == nil {
		// Only this goroutine creates ops, and the worker sees this one
		// only once it is queued: c.mu can be let go for bind, which takes
		// Transport.mu (locked before inConn.mu, never after).
		op = &rop{id: m.op, tag: m.tag, total: int64(m.total)}
		c.mu.Unlock()
		c.bind(op)
		c.mu.Lock()
		if c.ops == nil { // cannot happen while the reader runs
			return net.ErrClosed
		}
		c.ops[m.op] = op
	}
	if m.last != (m.offset == 0) {
		if m.last {
			c.expecting--
		} else {
			c.expecting++
		}
	}
	op.next += int64(m.length)
	op.wireEnded = m.last
	c.held[m.slot] = true
	c.push(item{op: op, last: m.last, offset: int64(m.offset), slot: int(m.slot), length: int(m.length), seq: seq})
	return nil
}

// onPost handles a POST: what the sender posted since the worker said
// IDLE. While the worker sleeps, the reader takes the parts itself when
// they end their ops (a small transfer: one part), and handles them and
// answers, as the worker would: waking the worker would cost a hand-off
// between goroutines, and with it, as Go's scheduler starts a thread for
// the goroutine it readies, a thread's wake-up, per op. Parts of an op
// with more to come, and any POST while the worker is awake, go to the
// worker, which watches the ring while such an op lasts. So does an op
// whose parts all came before the reader took them (a Send of several
// parts that filled the window meanwhile, as on a loaded host): the
// reader reads no message while it copies, so it would see neither a
// CANCEL nor the connection's end until every part was in, and would
// complete a receipt after its sender gave up on it, where the worker
// stops between parts.
func (c *inConn) onPost() {
	if !c.workMu.TryLock() {
		c.signal()
		return
	}
	defer c.workMu.Unlock()
	mapped, err := c.pull()
	if err != nil {
		c.fail(err)
		return
	}
	for {
		c.mu.Lock()
		if c.expecting > 0 || len(c.queue) > 0 && !c.queue[0].last && !c.queue[0].cancel {
			c.mu.Unlock()
			c.signal()
			return
		}
		if len(c.queue) == 0 {
			c.mu.Unlock()
			c.flush(mapped) // a failure closes the connection
			return
		}
		it := c.queue[0]
		c.queue[0] = item{}
		c.queue = c.queue[1:]
		c.mu.Unlock()
		c.handle(it)
	}
}

// signal wakes the worker.
func (c *inConn) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// drainWake drops a signal the worker has not taken yet. Only the worker
// calls it, before it looks at what signals announce: the ring (pull) and
// the queue, which signal's callers change before they signal.
func (c *inConn) drainWake() {
	if len(c.wake) > 0 {
		select {
		case <-c.wake:
		default:
		}
	}
}

// bind binds a new op to the receipt of its tag, or records why it is
// refused. c.mu must not be held.
func (c *inConn) bind(op *rop) {
	if c.winErr != nil {
		op.refuse, op.why = codeRegion, fmt.Sprintf("cannot map the sender's window: %v", c.winErr)
		return
	}
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	switch r := t.receipts.LookupLocked(op.tag); {
	case r == nil:
		op.refuse, op.why = codeUnknown, "no armed receipt for the tag (never armed, or ended: done, cancelled or failed)"
	case r.Fill != nil:
		op.refuse, op.why = codeBusy, "another Send is filling the receipt"
	case r.Total() != op.total:
		op.refuse, op.why = codeMismatch, fmt.Sprintf("the Send has %d bytes, the receipt %d", op.total, r.Total())
	default:
		r.Fill, op.r = op, r
	}
}

// push queues it for the worker. c.mu must be held. It does not wake the
// worker: pull's callers are the worker, the reader in onPost (both doing
// the worker's job) and onCancel, which wakes it.
func (c *inConn) push(it item) {
	c.queue = append(c.queue, it)
}

// onCancel marks an op cancelled and queues the cancel for the worker,
// after the parts posted before it, which it takes from the ring first;
// the worker answers ERR unless the op was answered already. A CANCEL for
// an op that is answered and forgotten crossed the answer: nothing to do.
func (c *inConn) onCancel(m msg) error {
	defer c.signal() // for the parts pulled and the cancel queued here
	if _, err := c.pull(); err != nil {
		return err
	}
	c.pullMu.Lock()
	taken := c.taken
	c.pullMu.Unlock()
	if m.seq > taken {
		return errProto("cancel of op %d after %d parts; the ring has %d", m.op, m.seq, taken)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	op := c.ops[m.op]
	if op == nil {
		return nil
	}
	if op.cancelled.Load() {
		return errProto("op %d cancelled twice", m.op)
	}
	op.cancelled.Store(true)
	if !op.wireEnded {
		c.expecting--
	}
	op.wireEnded = true
	c.push(item{op: op, cancel: true})
	return nil
}

// onAbort fails the receipt of a Send that ended before it posted a part,
// unless some op is filling it.
func (c *inConn) onAbort(m msg) {
	t := c.t
	t.mu.Lock()
	if r := t.receipts.LookupLocked(m.tag); r != nil && r.Fill == nil {
		r.FinishLocked(fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
	}
	t.mu.Unlock()
}

// onProbe answers a PROBE with the first 8 bytes of the window.
func (c *inConn) onProbe(m msg) error {
	switch {
	case c.slots == 0:
		return errProto("probe before the window was announced")
	case c.winErr != nil:
		return c.write(msg{typ: msgErr, op: m.op, code: codeRegion, text: fmt.Sprintf("cannot map the sender's window: %v", c.winErr)})
	case len(c.winMem) < 8:
		return c.write(msg{typ: msgErr, op: m.op, code: codeRegion, text: fmt.Sprintf("the window has %d bytes, fewer than 8", len(c.winMem))})
	}
	return c.write(msg{typ: msgProbeOK, op: m.op, nonce: binary.BigEndian.Uint64(c.winMem)})
}

// write sends messages to the sender, in one write. A failed write closes
// the connection, so that the reader ends and the connection is torn down,
// unless the sender has gone (EPIPE, ECONNRESET): then the reader ends
// on its own once it has read what the sender wrote last (a CANCEL, say).
func (c *inConn) write(ms ...msg) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wbuf = c.wbuf[:0]
	for i := range ms {
		c.wbuf = appendMsg(c.wbuf, &ms[i])
	}
	// A sender that stops reading must not hold the worker (and with it
	// the queue) forever.
	c.nc.SetWriteDeadline(time.Now().Add(helloTimeout))
	_, err := c.nc.Write(c.wbuf)
	if err == nil {
		c.wrote.Add(1)
	}
	if err != nil && !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
		c.nc.Close()
	}
	return err
}

// work takes the parts posted in the ring and handles them, and the
// cancels the reader queues, in order, until the connection dies. With
// nothing to do it looks at the ring for spinFor if an op has parts to
// come, then writes the messages it holds back and IDLE, and sleeps until
// a POST (or a cancel).
func (c *inConn) work() {
	defer c.t.wg.Done()
	defer close(c.workerDone)
	var spun time.Time // when the worker found nothing; zero: it has work
	// busy is set when the worker handled an item since it last slept: it
	// looks at the ring only then, so that a POST that brings nothing (a
	// sender can write any number) costs no more than the IDLE it gets.
	var busy bool
	c.workMu.Lock()
	defer c.workMu.Unlock()
	for !c.isDead.Load() {
		// A signal that came while the worker was awake (a POST while it
		// copied, the window mapped before it first ran, a cancel it is
		// about to take) asks for what the pull and the queue below see
		// anyway: dropped here, before them, it cannot wake the worker
		// again once it sleeps, to say IDLE a second time for nothing
		// (the sender would answer with a POST), nor cut every look of a
		// spin short; one that comes after this still wakes it.
		c.drainWake()
		mapped, err := c.pull()
		if err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		urgent, expecting := c.urgent, c.expecting
		if len(c.queue) > 0 {
			it := c.queue[0]
			c.queue[0] = item{}
			c.queue = c.queue[1:]
			c.mu.Unlock()
			if urgent { // answers and half a window of releases go first
				c.flush(false)
			}
			c.handle(it)
			spun, busy = time.Time{}, true
			continue
		}
		c.mu.Unlock()
		// Nothing to do. While a Send is in the middle of an op, its next
		// part comes soon: look for it a while before sleeping.
		if mapped && expecting > 0 && busy {
			if spun.IsZero() {
				spun = time.Now()
			}
			if time.Since(spun) < spinFor {
				if urgent {
					c.flush(false)
				}
				c.look()
				continue
			}
		}
		spun, busy = time.Time{}, false
		if c.flush(mapped) != nil {
			return // the connection is closed; teardown does the rest
		}
		c.workMu.Unlock() // the reader may handle a POST meanwhile (onPost)
		select {
		case <-c.wake:
		case <-c.dead:
		}
		c.workMu.Lock()
	}
}

// look waits a little (a microsecond or two) for the ring's count to
// change, or the reader to queue something, reading the count in a tight
// loop (the clock is read only between two looks); then it yields, to the
// goroutines of this process and to the threads of this CPU: the sender
// may be waiting for either (in this process, or on this CPU when the host
// is busy), and spinning in its way would hold it up until the spin ends.
// The ring must be mapped (pull said so).
func (c *inConn) look() {
	c.pullMu.Lock()
	count, taken := c.count, c.taken
	c.pullMu.Unlock()
	for range 512 {
		if count.Load() != taken || len(c.wake) > 0 {
			return
		}
	}
	runtime.Gosched()
	syscall.Syscall(syscall.SYS_SCHED_YIELD, 0, 0, 0) // x/sys/unix has no wrapper
}

// fail closes the connection for a protocol error the worker found in the
// ring; the reader then ends, and the connection is torn down with err.
func (c *inConn) fail(err error) {
	c.logEnd(err)
	c.mu.Lock()
	c.failed = err
	c.mu.Unlock()
	c.nc.Close()
}

// handle carries out one item: it copies a part (unless its op is refused,
// stopped or answered), releases its slot, and answers the op when it is
// decided.
func (c *inConn) handle(it item) {
	op, t := it.op, c.t
	c.mu.Lock()
	answered := op.answered
	c.mu.Unlock()
	var ans *msg
	switch {
	case answered:
	case it.cancel:
		if op.r != nil {
			t.mu.Lock()
			op.r.FinishLocked(fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
			t.mu.Unlock()
		}
		ans = &msg{typ: msgErr, op: op.id, code: codeAborted, text: "cancelled by the sender"}
	case op.refuse != 0:
		ans = &msg{typ: msgErr, op: op.id, code: op.refuse, text: op.why}
	default:
		ans = c.copyPart(op, it)
	}
	c.mu.Lock()
	if !it.cancel {
		c.held[it.slot] = false
		c.pending = append(c.pending, msg{typ: msgRelease, slot: uint32(it.slot)})
		c.nrel++
	}
	if ans != nil {
		op.answered = true
		c.pending = append(c.pending, *ans)
	}
	if op.answered && op.wireEnded && c.ops != nil && c.ops[op.id] == op {
		delete(c.ops, op.id)
	}
	// Releases wait, up to half the window: each message wakes the
	// sender, which has the other half to fill meanwhile. The worker
	// writes them, and answers, before its next item, or as it goes to
	// sleep (work).
	c.urgent = c.urgent || ans != nil || 2*c.nrel >= c.slots
	c.mu.Unlock()
}

// flush writes the messages the worker holds back and, if idle, IDLE with
// the count of parts taken from the ring, in one write. A failure closes
// the connection; teardown does the rest.
func (c *inConn) flush(idle bool) error {
	var taken uint64
	if idle {
		c.pullMu.Lock()
		taken = c.taken
		c.pullMu.Unlock()
	}
	c.mu.Lock()
	ms := append(c.out[:0], c.pending...)
	c.pending, c.nrel, c.urgent = c.pending[:0], 0, false
	c.mu.Unlock()
	if idle {
		ms = append(ms, msg{typ: msgIdle, seq: taken})
	}
	c.out = ms
	if len(ms) == 0 {
		return nil
	}
	return c.write(ms...)
}

// copyPart copies one part out of the window into the op's receipt. It
// returns the op's answer when the op is decided (DONE after its last
// part, ERR when it stops), nil when more parts are to come.
func (c *inConn) copyPart(op *rop, it item) *msg {
	t, r := c.t, op.r
	t.mu.Lock()
	switch {
	case r.Ended():
		code, why := endCode(r.ErrLocked())
		t.mu.Unlock()
		return &msg{typ: msgErr, op: op.id, code: code, text: why}
	case op.cancelled.Load():
		r.FinishLocked(fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
		t.mu.Unlock()
		return &msg{typ: msgErr, op: op.id, code: codeAborted, text: "cancelled by the sender"}
	case it.last && c.gaveUp(it.seq):
		defer t.mu.Unlock()
		return c.givenUpLocked(op)
	}
	r.HoldLocked()
	t.mu.Unlock()
	if h := testHookPiece.Load(); h != nil {
		(*h)()
	}
	src := c.winMem[it.slot*c.slotLen : it.slot*c.slotLen+it.length]
	r.Dst().CopyAt(it.offset, src)

	t.mu.Lock()
	defer t.mu.Unlock()
	r.ReleaseLocked()
	if !it.last {
		return nil
	}
	if r.Ended() { // ended as the last part went in
		code, why := endCode(r.ErrLocked())
		return &msg{typ: msgErr, op: op.id, code: code, text: why}
	}
	// Every byte is in place. Unless the sender gave up on the op while
	// it was copied (or before, with this side stalled past the CANCEL's
	// grace: see the ring's gave-up word in wire.go), the receipt
	// completes now, before DONE goes out (protocol 3 waited for the
	// sender's ACK of DONE, a third hop and a third wake-up of each
	// process per op).
	if c.gaveUp(it.seq) {
		return c.givenUpLocked(op)
	}
	r.FinishLocked(nil)
	return &msg{typ: msgDone, op: op.id}
}

// gaveUp reads the gave-up word of the ring entry of part seq, which the
// sender sets when it gives up on the op of that last part (wire.go).
// The entry is intact while its part is held (the sender reuses it only
// for a part posted after this one's release).
func (c *inConn) gaveUp(seq uint64) bool {
	at := ringHdr + int(seq%uint64(c.slots))*readLen + gaveUpAt
	return (*atomic.Uint32)(unsafe.Pointer(&c.ring[at])).Load() != 0
}

// givenUpLocked fails op's receipt because its sender gave up on it, and
// returns the answer: ERR, aborted. Transport.mu must be held.
func (c *inConn) givenUpLocked(op *rop) *msg {
	op.r.FinishLocked(fmt.Errorf("shm: receive from %s: %w (the sender gave up on it)", c.remote, transport.ErrAborted))
	return &msg{typ: msgErr, op: op.id, code: codeAborted, text: "the sender gave up on the op"}
}

// endCode is the ERR code of an op whose receipt ended with err.
func endCode(err error) (uint32, string) {
	if errors.Is(err, net.ErrClosed) {
		return codeClosing, "the receiving transport is closing"
	}
	return codeCanceled, fmt.Sprintf("the receiver cancelled the receipt: %v", err)
}
