//go:build linux

package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transport"
)

// maxMapped bounds the bytes of peers' regions one Transport maps at once
// (virtual address space, not memory: a region is the sender's memory). A
// region past it is refused (ERR, "cannot map") rather than let a peer
// exhaust the address space of this process.
const maxMapped = 1 << 45

// testHookPiece, when set, is called by copiers before every piece they
// copy. Tests use it to hold a transfer in the middle.
var testHookPiece atomic.Pointer[func()]

// recv is one armed receipt.
type recv struct {
	t     *Transport
	tag   uint64
	desc  transport.Descriptor
	dst   [][]byte
	ends  []int64 // ends[i]: offset just past dst[i] in the receipt
	total int64
	done  chan struct{}
	// finished is set (under t.mu) when the receipt has ended; copiers
	// test it between pieces without the lock.
	finished atomic.Bool

	// Guarded by t.mu.
	err    error
	active int  // copiers between taking dst and letting go of it
	op     *rop // the op filling it; nil before its READ
	closed bool // done is closed
}

var _ transport.Recv = (*recv)(nil)

// Op states on the receiving side.
const (
	opAssembling = iota // READ parts arriving
	opQueued            // waiting for the worker
	opCopying           // the worker copies it
	opAwaitAck          // DONE sent; the receipt completes at ACK
)

// rop is one op, the receiving side of one Send.
type rop struct {
	id     uint64
	tag    uint64
	srcs   [][]byte // pieces of the peer's regions, in order
	ends   []int64  // ends[i]: offset just past srcs[i] in the op
	total  int64
	weight int64  // credit it holds (see connCredit)
	refuse uint32 // an ERR code decided while assembling; 0: none
	why    string
	r      *recv // the receipt it fills, once queued
	// cancelled is set by the sender's CANCEL; copiers test it.
	cancelled atomic.Bool

	state int // guarded by inConn.mu
}

// peerRegion is a sender's region as mapped here, read-only.
type peerRegion struct {
	size  uint64
	arena kvcache.Arena // nil when it could not be mapped
	mem   []byte
	err   error // why it could not be mapped
}

// inConn is an accepted connection: a reader goroutine (serve) that
// handles messages, and a worker goroutine (work) that copies the ops the
// reader queues, one at a time, in order.
type inConn struct {
	t      *Transport
	nc     *net.UnixConn
	remote string
	mr     *msgReader             // the reader's
	regs   map[uint32]*peerRegion // the reader's; unmapped after the worker ends

	dead       chan struct{} // closed when the reader stops
	isDead     atomic.Bool
	wake       chan struct{} // the queue has grown
	workerDone chan struct{}

	wmu  sync.Mutex
	wbuf []byte // guarded by wmu

	mu    sync.Mutex
	ops   map[uint64]*rop // assembling, queued, copying or awaiting ACK
	queue []*rop
	used  int64 // credit of the ops not answered yet
}

func newInConn(t *Transport, nc *net.UnixConn) *inConn {
	return &inConn{
		t:          t,
		nc:         nc,
		remote:     peerName(nc),
		mr:         newMsgReader(nc),
		regs:       make(map[uint32]*peerRegion),
		dead:       make(chan struct{}),
		wake:       make(chan struct{}, 1),
		workerDone: make(chan struct{}),
		ops:        make(map[uint64]*rop),
	}
}

// Expect arms a receipt of sum(len(dst[i])) bytes under a fresh random tag.
// dst can be any memory; it need not be registered.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	ends := make([]int64, len(dst))
	var total int64
	for i, b := range dst {
		total += int64(len(b))
		ends[i] = total
	}
	if total == 0 {
		return nil, errors.New("shm: expect: nothing to receive (total length 0)")
	}
	r := &recv{t: t, dst: dst, ends: ends, total: total, done: make(chan struct{})}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil, &transport.ClosedError{Op: "expect"}
	}
	for r.tag == 0 || t.receipts[r.tag] != nil {
		r.tag = randUint64()
	}
	t.receipts[r.tag] = r
	t.mu.Unlock()
	r.desc = descriptor{endpoint: t.endpoint, tag: r.tag, total: total}.encode()
	return r, nil
}

// Descriptor returns a copy of the receipt's descriptor.
func (r *recv) Descriptor() transport.Descriptor { return slices.Clone(r.desc) }

// Done is closed when the receipt has ended and nothing copies into dst.
func (r *recv) Done() <-chan struct{} { return r.done }

// Err returns why the receipt failed, or nil before Done and on success.
func (r *recv) Err() error {
	select {
	case <-r.done:
		return r.err
	default:
		return nil
	}
}

// Cancel ends the receipt with ErrCanceled unless it has ended, then waits
// until nothing copies into dst: a copy in progress stops before its next
// piece (at most Options.FrameBytes). The Send filling it, if any, fails
// with ErrRefused and transport.ErrCanceled, unless the receiver had
// already told it that every byte was copied.
func (r *recv) Cancel() {
	t := r.t
	t.mu.Lock()
	t.finish(r, fmt.Errorf("shm: receive: %w", transport.ErrCanceled))
	t.mu.Unlock()
	<-r.done
}

// finish ends r with err (nil: success) unless it has ended. Done closes
// now, or when the last copier lets go. t.mu must be held.
func (t *Transport) finish(r *recv, err error) {
	if r.finished.Load() {
		return
	}
	r.err = err
	r.finished.Store(true)
	if t.receipts[r.tag] == r {
		delete(t.receipts, r.tag)
	}
	if r.active == 0 {
		r.closed = true
		close(r.done)
	}
}

// release is called by a copier that lets go of r's dst. t.mu must be held.
func (t *Transport) release(r *recv) {
	r.active--
	if r.active == 0 && r.finished.Load() && !r.closed {
		r.closed = true
		close(r.done)
	}
}

// serve runs the reader of an accepted connection, then tears it down.
func (c *inConn) serve() {
	defer c.t.wg.Done()
	err := c.readLoop()
	switch {
	case errors.Is(err, transport.ErrProtocol):
		c.t.log.Warn("shm: closing connection", "remote", c.remote, "err", err)
	case !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed):
		c.t.log.Debug("shm: connection broke", "remote", c.remote, "err", err)
	}
	c.teardown(err)
}

// teardown closes the connection, stops the worker (closing first frees a
// worker blocked writing an answer), fails the receipts this connection
// was filling (ErrPeerLost), unmaps the peer's regions once nothing copies
// out of them, and closes every descriptor received.
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
			t.finish(op.r, lost)
		}
	}
	c.ops, c.queue = nil, nil
	c.mu.Unlock()
	t.mu.Unlock()
	for _, pr := range c.regs {
		if pr.arena != nil {
			if err := pr.arena.Close(); err != nil {
				t.log.Warn("shm: unmapping a peer's region", "remote", c.remote, "err", err)
			}
			t.mapped.Add(-int64(pr.size))
		}
	}
	c.regs = nil
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
	c.nc.SetReadDeadline(time.Time{})
	if err := c.write(&msg{typ: msgHello, version: protoVersion}); err != nil {
		return err
	}
	for {
		m, err := c.mr.next()
		if err != nil {
			return err
		}
		switch m.typ {
		case msgRegion:
			err = c.onRegion(m)
		case msgRead:
			err = c.onRead(m)
		case msgCancel:
			err = c.onCancel(m)
		case msgAbort:
			c.onAbort(m)
		case msgAck:
			err = c.onAck(m)
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

// onRegion maps an announced region, read-only. A region that cannot be
// mapped is remembered with the reason, which the ops that read it get.
func (c *inConn) onRegion(m msg) error {
	fd, ok := c.mr.takeFd()
	if !ok {
		return errProto("region %d announced without its memory file", m.region)
	}
	f := fdFile(fd, "shm peer region")
	defer f.Close() // the mapping does not need it
	if _, dup := c.regs[m.region]; dup {
		return errProto("region %d announced twice", m.region)
	}
	if len(c.regs) >= maxRegions {
		return errProto("more than %d regions announced", maxRegions)
	}
	pr := &peerRegion{size: m.size}
	c.regs[m.region] = pr
	if c.t.mapped.Add(int64(m.size)) > maxMapped {
		c.t.mapped.Add(-int64(m.size))
		pr.err = fmt.Errorf("peers' regions mapped here would exceed %d bytes", int64(maxMapped))
		return nil
	}
	a, err := kvcache.MapShared(f, int64(m.size))
	if err == nil {
		// Nothing here ever writes into a peer's memory; let the MMU
		// hold us to that.
		if err = syscall.Mprotect(a.Bytes(), syscall.PROT_READ); err != nil {
			a.Close()
			err = fmt.Errorf("mprotect: %w", err)
		}
	}
	if err != nil {
		c.t.mapped.Add(-int64(m.size))
		c.t.log.Warn("shm: cannot map a peer's region", "remote", c.remote, "region", m.region, "size", m.size, "err", err)
		pr.err = err
		return nil
	}
	pr.arena, pr.mem = a, a.Bytes()
	return nil
}

// onRead adds a READ part to its op; the last part queues the op for the
// worker, or refuses it.
func (c *inConn) onRead(m msg) error {
	c.mu.Lock()
	op := c.ops[m.op]
	w := int64(len(m.segs))
	if m.offset == 0 && op == nil {
		w += opWeight
	}
	switch {
	case m.offset == 0 && op != nil:
		c.mu.Unlock()
		return errProto("op %d started twice", m.op)
	case m.offset != 0 && (op == nil || op.state != opAssembling || op.tag != m.tag || uint64(op.total) != m.offset):
		c.mu.Unlock()
		return errProto("read part of op %d at offset %d out of sequence", m.op, m.offset)
	case c.used+w > c.t.credit:
		c.mu.Unlock()
		return errProto("ops in flight exceed the credit of a connection (%d)", c.t.credit)
	}
	if op == nil {
		op = &rop{id: m.op, tag: m.tag}
		c.ops[m.op] = op
	}
	op.weight += w
	c.used += w
	c.mu.Unlock()

	// Only the reader touches an op while it is assembling.
	if len(op.ends)+len(m.segs) > maxOpSegs {
		return errProto("op %d has more than %d segments", m.op, maxOpSegs)
	}
	for _, s := range m.segs {
		pr := c.regs[s.region]
		switch {
		case pr == nil:
			return errProto("op %d reads region %d, which was not announced", m.op, s.region)
		case s.offset+s.length > pr.size:
			return errProto("op %d reads [%d, +%d) of region %d, which has %d bytes", m.op, s.offset, s.length, s.region, pr.size)
		case uint64(op.total) > math.MaxInt64-s.length:
			return errProto("op %d is longer than %d bytes", m.op, int64(math.MaxInt64))
		}
		op.total += int64(s.length)
		op.ends = append(op.ends, op.total)
		if pr.err != nil && op.refuse == 0 {
			op.refuse, op.why = codeRegion, fmt.Sprintf("cannot map region %d: %v", s.region, pr.err)
		}
		if op.refuse == 0 {
			op.srcs = append(op.srcs, pr.mem[s.offset:s.offset+s.length:s.offset+s.length])
		}
	}
	if !m.last {
		return nil
	}
	return c.queueOp(op)
}

// queueOp binds a complete op to its receipt and queues it, or refuses it.
func (c *inConn) queueOp(op *rop) error {
	code, why := op.refuse, op.why
	if code == 0 {
		t := c.t
		t.mu.Lock()
		switch r := t.receipts[op.tag]; {
		case r == nil:
			code, why = codeUnknown, "no armed receipt for the tag (never armed, or ended: done, cancelled or failed)"
		case r.op != nil:
			code, why = codeBusy, "another Send is filling the receipt"
		case r.total != op.total:
			code, why = codeMismatch, fmt.Sprintf("the Send has %d bytes, the receipt %d", op.total, r.total)
		default:
			r.op, op.r = op, r
		}
		t.mu.Unlock()
	}
	if code != 0 {
		return c.replyErr(op, code, why)
	}
	c.mu.Lock()
	op.state = opQueued
	c.queue = append(c.queue, op)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	return nil
}

// onCancel marks an op cancelled; the worker stops it at its next piece
// (or before it starts) and answers ERR, unless it has answered DONE.
func (c *inConn) onCancel(m msg) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	op := c.ops[m.op]
	switch {
	case op == nil: // answered already: the CANCEL crossed the answer
		return nil
	case op.state == opAssembling:
		return errProto("cancel of op %d in the middle of its reads", m.op)
	}
	op.cancelled.Store(true)
	return nil
}

// onAbort fails the receipt of a Send that ended before it sent its READ,
// unless some op is filling it.
func (c *inConn) onAbort(m msg) {
	t := c.t
	t.mu.Lock()
	if r := t.receipts[m.tag]; r != nil && r.op == nil {
		t.finish(r, fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
	}
	t.mu.Unlock()
}

// onAck completes the receipt of an op answered DONE.
func (c *inConn) onAck(m msg) error {
	c.mu.Lock()
	op := c.ops[m.op]
	if op == nil || op.state != opAwaitAck {
		c.mu.Unlock()
		return errProto("ack of op %d, which is not done", m.op)
	}
	delete(c.ops, m.op)
	c.mu.Unlock()
	t := c.t
	t.mu.Lock()
	t.finish(op.r, nil) // a no-op if it was cancelled meanwhile
	t.mu.Unlock()
	return nil
}

// onProbe answers a PROBE with the first 8 bytes of the region.
func (c *inConn) onProbe(m msg) error {
	pr := c.regs[m.region]
	switch {
	case pr == nil:
		return errProto("probe of region %d, which was not announced", m.region)
	case pr.err != nil:
		return c.write(&msg{typ: msgErr, op: m.op, code: codeRegion, text: fmt.Sprintf("cannot map region %d: %v", m.region, pr.err)})
	case pr.size < 8:
		return c.write(&msg{typ: msgErr, op: m.op, code: codeRegion, text: fmt.Sprintf("region %d has %d bytes, fewer than 8", m.region, pr.size)})
	}
	return c.write(&msg{typ: msgProbeOK, op: m.op, nonce: binary.BigEndian.Uint64(pr.mem)})
}

// write sends one message to the sender. A failed write closes the
// connection, so that the reader ends and the connection is torn down.
func (c *inConn) write(m *msg) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wbuf = appendMsg(c.wbuf[:0], m)
	_, err := c.nc.Write(c.wbuf)
	if err != nil {
		c.nc.Close()
	}
	return err
}

// replyErr answers op with ERR and forgets it. Its credit is returned
// before the answer goes out, as the sender counts on.
func (c *inConn) replyErr(op *rop, code uint32, why string) error {
	c.mu.Lock()
	if c.ops != nil {
		delete(c.ops, op.id)
	}
	c.used -= op.weight
	c.mu.Unlock()
	return c.write(&msg{typ: msgErr, op: op.id, code: code, text: why})
}

// replyDone answers op with DONE; the receipt completes at the ACK.
func (c *inConn) replyDone(op *rop) error {
	c.mu.Lock()
	op.state = opAwaitAck
	op.srcs, op.ends = nil, nil
	c.used -= op.weight
	c.mu.Unlock()
	return c.write(&msg{typ: msgDone, op: op.id})
}

// work copies the queued ops, in order, until the connection dies.
func (c *inConn) work() {
	defer c.t.wg.Done()
	defer close(c.workerDone)
	for {
		c.mu.Lock()
		for len(c.queue) == 0 {
			c.mu.Unlock()
			select {
			case <-c.wake:
			case <-c.dead:
				return
			}
			c.mu.Lock()
		}
		op := c.queue[0]
		c.queue[0] = nil
		c.queue = c.queue[1:]
		op.state = opCopying
		c.mu.Unlock()
		if c.isDead.Load() {
			return // teardown fails its receipt
		}
		c.serveOp(op)
	}
}

// How a copy ended, in increasing order of precedence.
const (
	copyDone      = iota // every byte copied
	copyLetGo            // the receipt ended (Cancel, Close)
	copyCancelled        // the sender's CANCEL
	copyDead             // the connection died
)

// serveOp copies op into its receipt and answers the sender.
func (c *inConn) serveOp(op *rop) {
	t, r := c.t, op.r
	t.mu.Lock()
	switch {
	case r.finished.Load():
		code, why := endCode(r.err)
		t.mu.Unlock()
		c.replyErr(op, code, why)
		return
	case op.cancelled.Load():
		t.finish(r, fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
		t.mu.Unlock()
		c.replyErr(op, codeAborted, "cancelled by the sender")
		return
	}
	r.active++
	t.mu.Unlock()

	st := c.copy(op, r)

	t.mu.Lock()
	t.release(r)
	if st == copyDone && r.finished.Load() {
		st = copyLetGo // ended as the last piece went in
	}
	var code uint32
	var why string
	switch st {
	case copyLetGo:
		code, why = endCode(r.err)
	case copyCancelled:
		t.finish(r, fmt.Errorf("shm: receive from %s: %w", c.remote, transport.ErrAborted))
		code, why = codeAborted, "cancelled by the sender"
	}
	t.mu.Unlock()
	switch st {
	case copyDone:
		c.replyDone(op)
	case copyLetGo, copyCancelled:
		c.replyErr(op, code, why)
	}
	// copyDead: teardown fails the receipt; nobody to answer.
}

// endCode is the ERR code of an op whose receipt ended with err.
func endCode(err error) (uint32, string) {
	if errors.Is(err, net.ErrClosed) {
		return codeClosing, "the receiving transport is closing"
	}
	return codeCanceled, fmt.Sprintf("the receiver cancelled the receipt: %v", err)
}

// copy copies op into r's dst: on two goroutines (the worker and one it
// joins) when the op is at least two pieces long and two CPUs are there.
func (c *inConn) copy(op *rop, r *recv) int {
	n, piece := op.total, int64(c.t.piece)
	if c.t.copiers < 2 || n < 2*piece {
		return c.copyRange(op, r, 0, n)
	}
	half := n / 2 &^ 4095 // page-aligned cut: both halves copy fast
	var st2 int
	var wg sync.WaitGroup
	wg.Go(func() { st2 = c.copyRange(op, r, half, n) })
	st1 := c.copyRange(op, r, 0, half)
	wg.Wait()
	return max(st1, st2)
}

// copyRange copies bytes [lo, hi) of op into r's dst, piece by piece,
// checking before each piece that it should go on.
func (c *inConn) copyRange(op *rop, r *recv, lo, hi int64) int {
	piece := int64(c.t.piece)
	si, di := pieceAt(op.ends, lo), pieceAt(r.ends, lo)
	for pos := lo; pos < hi; {
		if st := c.check(op, r); st != copyDone {
			return st
		}
		for r.ends[di] <= pos { // empty pieces of dst
			di++
		}
		s := op.srcs[si][pos-(op.ends[si]-int64(len(op.srcs[si]))):]
		d := r.dst[di][pos-(r.ends[di]-int64(len(r.dst[di]))):]
		k := min(int64(len(s)), int64(len(d)), piece, hi-pos)
		copy(d[:k], s[:k])
		pos += k
		if pos == op.ends[si] {
			si++
		}
	}
	return copyDone
}

// check reports whether a copy should go on (copyDone) or why not.
func (c *inConn) check(op *rop, r *recv) int {
	if h := testHookPiece.Load(); h != nil {
		(*h)()
	}
	switch {
	case c.isDead.Load():
		return copyDead
	case op.cancelled.Load():
		return copyCancelled
	case r.finished.Load():
		return copyLetGo
	}
	return copyDone
}

// pieceAt returns the index of the piece that holds offset off: the first
// i with ends[i] > off.
func pieceAt(ends []int64, off int64) int {
	lo, hi := 0, len(ends)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if ends[m] > off {
			hi = m
		} else {
			lo = m + 1
		}
	}
	return lo
}
