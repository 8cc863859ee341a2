//go:build mpi && cgo

package mpi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/kvxfer/kvxfer/transport"
)

// sendWindow is how many frames of one Send are in flight at once.
const sendWindow = 4

// Transport is one data plane on the process's MPI world. Several may be
// open in one process; each has its own receipts, and its Endpoint names
// the world rank and its number within the process.
type Transport struct {
	w          *world
	id         uint32
	frameBytes int
	log        *slog.Logger

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	recvs   map[uint64]*recv // not yet done
	sending sync.WaitGroup

	adviceLogged atomic.Bool // RegisterMemory logged that huge pages were refused
}

// Open opens a Transport on the world Init made; ctx is not used (opening
// waits for nothing). It fails with ErrNotInitialised before Init.
// opts.FrameBytes sets the size of one MPI message of a transfer (a
// receipt's choice, told to its sender), except that the generic default
// (transport.DefaultFrameBytes) means MPI's own, FrameBytes; the listening options
// (ListenAddr, Interface, TLS, connection bounds) do not apply.
func Open(_ context.Context, opts transport.Options) (*Transport, error) {
	opts = opts.WithDefaults()
	w, err := current()
	if err != nil {
		return nil, fmt.Errorf("mpi: open: %w", err)
	}
	t := &Transport{
		w:          w,
		frameBytes: frameBytesFor(opts.FrameBytes),
		log:        opts.Logger,
		closing:    make(chan struct{}),
		recvs:      map[uint64]*recv{},
	}
	w.mu.Lock()
	w.nextTID++
	t.id = w.nextTID
	w.transports[t.id] = t
	w.mu.Unlock()
	t.log.Info("mpi: data plane open", "endpoint", t.Endpoint(), "world_size", w.size)
	return t, nil
}

// Name returns "mpi".
func (t *Transport) Name() string { return "mpi" }

// Endpoint is "mpi:RANK.ID": the world rank and the transport's number in
// its process.
func (t *Transport) Endpoint() string { return fmt.Sprintf("mpi:%d.%d", t.w.rank, t.id) }

// recv is one armed receipt. Its fields after dst are owned by the
// progress goroutine once Expect has returned.
type recv struct {
	t     *Transport
	id    uint64
	dst   [][]byte
	total int64
	d     transport.Descriptor
	pin   runtime.Pinner
	done  chan struct{}
	err   error // set before done closes

	claimed    bool
	finished   bool // done closed
	src        int  // the sender's rank, once claimed
	sid        uint64
	tag        int
	frameBytes int
	frames     []int // slot of each frame's receive; -1 once completed
	pending    int
	cancelled  []int // frames whose receive was cancelled
	ending     error // why the receipt ends early (nil: it has not)
	local      bool  // ended by Cancel or Close: stop sent, a count awaited
	count      uint64
	counted    bool
}

func (r *recv) Descriptor() transport.Descriptor { return r.d }
func (r *recv) Done() <-chan struct{}            { return r.done }
func (r *recv) Err() error {
	select {
	case <-r.done:
		return r.err
	default:
		return nil
	}
}

// Cancel ends the receipt with transport.ErrCanceled unless it has ended,
// and returns once no MPI receive writes into dst.
func (r *recv) Cancel() {
	select {
	case <-r.done:
		return
	default:
	}
	r.t.w.do(func() {
		r.t.w.endLocal(r, fmt.Errorf("mpi: receipt %d: %w", r.id, transport.ErrCanceled), codeCanceled)
	})
	<-r.done
}

// Expect arms a receipt of dst; see transport.Transport.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	var total int64
	for _, p := range dst {
		total += int64(len(p))
	}
	if total == 0 {
		return nil, errors.New("mpi: expect: nothing to receive (0 bytes)")
	}
	w := t.w
	r := &recv{t: t, dst: dst, total: total, done: make(chan struct{})}
	// Pinned before the receipt is findable: the progress goroutine
	// unpins it when it ends.
	for _, p := range dst {
		if len(p) > 0 {
			r.pin.Pin(&p[0])
		}
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		r.pin.Unpin()
		return nil, &transport.ClosedError{Op: "expect"}
	}
	w.mu.Lock()
	w.nextRID++
	r.id = w.nextRID
	r.d = desc{Epoch: w.epoch, Rank: w.rank, Transport: t.id, Receipt: r.id, Total: total}.encode()
	w.recvs[r.id] = r
	w.mu.Unlock()
	t.recvs[r.id] = r
	t.mu.Unlock()
	// The Send's rts follows soon: the progress goroutine spins for it
	// rather than sleeping through it.
	w.poke()
	return r, nil
}

// finish ends r with err (progress goroutine): done closes, dst is the
// caller's again.
func (w *world) finish(r *recv, err error) {
	if r.finished {
		return
	}
	r.finished = true
	r.err = err
	r.pin.Unpin()
	close(r.done)
	r.t.mu.Lock()
	delete(r.t.recvs, r.id)
	r.t.mu.Unlock()
	if !r.local || !r.claimed {
		w.forget(r)
	} else {
		w.sinkIfCounted(r)
	}
}

func (w *world) forget(r *recv) {
	w.mu.Lock()
	delete(w.recvs, r.id)
	w.mu.Unlock()
}

// endLocal ends r early from this side (Cancel, Close): at once if no
// Send has claimed it, else by cancelling its frame receives and telling
// the sender to stop (progress goroutine).
func (w *world) endLocal(r *recv, err error, code uint8) {
	if r.finished || r.ending != nil {
		return
	}
	if !r.claimed {
		w.finish(r, err)
		return
	}
	r.ending, r.local = err, true
	for _, s := range r.frames {
		if s >= 0 {
			w.cancelReq(s)
		}
	}
	w.sendCtl(r.src, ctlMsg{Kind: ctlStop, Code: code, Receipt: r.id, Send: r.sid})
	if r.pending == 0 {
		w.finish(r, err)
	}
}

// sinkIfCounted drains, once the sender has said how many frames it
// posted, those of them whose receive was cancelled, and forgets r.
func (w *world) sinkIfCounted(r *recv) {
	if !r.finished || !r.counted {
		return
	}
	k := r.count
	if k == allFrames {
		k = uint64(len(r.frames))
	}
	for _, i := range r.cancelled {
		if uint64(i) < k {
			w.postSink(r.src, r.tag, r.frameLen(i))
		}
	}
	w.forget(r)
}

func (r *recv) frameLen(i int) int {
	off := int64(i) * int64(r.frameBytes)
	return int(min(int64(r.frameBytes), r.total-off))
}

// claim gives r to the Send sid of rank src: it posts every frame's
// receive and answers cts (progress goroutine).
func (w *world) claim(r *recv, src int, sid uint64) {
	r.claimed, r.src, r.sid = true, src, sid
	r.tag = w.tag()
	r.frameBytes = r.t.frameBytes
	n := frameCount(r.total, r.frameBytes)
	r.frames = make([]int, n)
	for i := range n {
		r.frames[i] = -1
	}
	for i := range n {
		off := int64(i) * int64(r.frameBytes)
		ln := r.frameLen(i)
		slot, err := w.postData(true, src, r.tag, r.dst, frameBlocks(r.dst, off, ln), func(c completion) { w.frameReceived(r, i, ln, c) })
		if err != nil {
			// Those posted are cancelled; the sender hears stop and
			// counts what it never sent (none).
			w.endLocal(r, fmt.Errorf("mpi: receipt %d: post frame %d: %w", r.id, i, err), codeCanceled)
			w.sendCtl(src, ctlMsg{Kind: ctlNack, Code: codeGone, Receipt: r.id, Send: sid})
			return
		}
		r.frames[i] = slot
		r.pending++
	}
	w.sendCtl(src, ctlMsg{Kind: ctlCTS, Receipt: r.id, Send: sid, A: uint64(r.tag), B: uint64(r.frameBytes)})
}

func (w *world) frameReceived(r *recv, i, want int, c completion) {
	r.frames[i] = -1
	r.pending--
	switch {
	case c.Cancelled:
		r.cancelled = append(r.cancelled, i)
	case c.Err != nil && r.ending == nil:
		r.ending = fmt.Errorf("mpi: receipt %d frame %d from rank %d: %w", r.id, i, r.src, c.Err)
	case c.Count != want && r.ending == nil:
		r.ending = fmt.Errorf("%w: mpi: receipt %d frame %d from rank %d: %d bytes, want %d", transport.ErrProtocol, r.id, i, r.src, c.Count, want)
	}
	if r.pending == 0 {
		w.finish(r, r.ending)
	}
}

// send is one Send in progress. Its fields after done are owned by the
// progress goroutine.
type send struct {
	t      *Transport
	id     uint64
	d      desc
	src    [][]byte
	done   chan struct{}
	err    error
	frames int

	started  bool // rts sent
	cts      bool
	tag      int
	fb       int
	posted   int
	inflight int
	stopping error // set once the Send will post no more frames
	counted  bool  // count sent
	ended    bool
}

// Send delivers src to the receipt desc names; see transport.Transport.
// A Send whose ctx ends, or whose transport closes, stops posting frames,
// tells the receiver how many it posted, and returns once MPI has let go
// of those (a send in flight cannot be cancelled in MPI: it is drained).
func (t *Transport) Send(ctx context.Context, d transport.Descriptor, src [][]byte) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return &transport.ClosedError{Op: "send"}
	}
	t.sending.Add(1)
	t.mu.Unlock()
	defer t.sending.Done()
	w := t.w
	dd, err := decodeDesc(d)
	if err != nil {
		return fmt.Errorf("mpi: send: %w", err)
	}
	if dd.Epoch != w.epoch || dd.Rank >= w.size {
		return fmt.Errorf("%w: mpi: send: descriptor of another MPI world (rank %d of %d)", transport.ErrBadDescriptor, dd.Rank, w.size)
	}
	var total int64
	for _, p := range src {
		total += int64(len(p))
	}
	if total != dd.Total {
		return fmt.Errorf("%w: mpi: send to %s: %d bytes offered, the receipt expects %d", transport.ErrBadDescriptor, peerName(dd), total, dd.Total)
	}
	s := &send{t: t, d: dd, src: src, done: make(chan struct{})}
	if err := ctx.Err(); err != nil {
		w.do(func() {
			w.sendCtl(dd.Rank, ctlMsg{Kind: ctlCount, Code: codeAbort, Receipt: dd.Receipt, A: 0})
		})
		return ctxError(ctx, peerName(dd))
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	for _, p := range src {
		if len(p) > 0 {
			pin.Pin(&p[0])
		}
	}
	w.mu.Lock()
	w.nextSID++
	s.id = w.nextSID
	w.sends[s.id] = s
	w.mu.Unlock()
	w.do(func() {
		s.started = true
		w.sendCtl(dd.Rank, ctlMsg{Kind: ctlRTS, Transport: dd.Transport, Receipt: dd.Receipt, Send: s.id, A: uint64(total)})
	})
	select {
	case <-s.done:
		return s.err
	case <-ctx.Done():
		err := ctxError(ctx, peerName(dd))
		w.do(func() { w.stopSend(s, err) })
	case <-t.closing:
		w.do(func() { w.stopSend(s, &transport.ClosedError{Op: "send"}) })
	}
	<-s.done
	return s.err
}

func peerName(d desc) string { return fmt.Sprintf("mpi:%d.%d", d.Rank, d.Transport) }

func ctxError(ctx context.Context, peer string) error {
	err := ctx.Err()
	if errors.Is(err, context.DeadlineExceeded) {
		return &transport.TimeoutError{Op: "send", Peer: peer, Err: err}
	}
	return fmt.Errorf("mpi: send to %s: %w", peer, err)
}

// stopSend makes s post no more frames and tells the receiver how many it
// posted; s ends once those are drained (progress goroutine).
func (w *world) stopSend(s *send, err error) {
	if s.ended || s.stopping != nil {
		return
	}
	if s.cts && s.posted == s.frames {
		// Every frame is posted: the receiver gets all of them, and the
		// Send ends (with nil) once they are drained.
		return
	}
	s.stopping = err
	if !s.counted {
		s.counted = true
		w.sendCtl(s.d.Rank, ctlMsg{Kind: ctlCount, Code: codeAbort, Receipt: s.d.Receipt, Send: s.id, A: uint64(s.posted)})
	}
	w.endSendIfDrained(s)
}

func (w *world) endSendIfDrained(s *send) {
	if s.ended || s.inflight > 0 {
		return
	}
	if s.stopping == nil && (!s.cts || s.posted < s.frames) {
		return
	}
	s.ended = true
	s.err = s.stopping
	w.mu.Lock()
	delete(w.sends, s.id)
	w.mu.Unlock()
	close(s.done)
}

// postFrames posts s's next frames up to the window.
func (w *world) postFrames(s *send) {
	for s.stopping == nil && s.inflight < sendWindow && s.posted < s.frames {
		i := s.posted
		off := int64(i) * int64(s.fb)
		ln := int(min(int64(s.fb), s.d.Total-off))
		_, err := w.postData(false, s.d.Rank, s.tag, s.src, frameBlocks(s.src, off, ln), func(c completion) {
			s.inflight--
			if c.Err != nil && s.stopping == nil {
				w.stopSend(s, fmt.Errorf("mpi: send to %s frame %d: %w: %w", peerName(s.d), i, transport.ErrPeerLost, c.Err))
				return
			}
			w.postFrames(s)
			w.endSendIfDrained(s)
		})
		if err != nil {
			w.stopSend(s, fmt.Errorf("mpi: send to %s frame %d: %w", peerName(s.d), i, err))
			return
		}
		s.posted++
		s.inflight++
	}
}

// dispatch handles a control message from rank src (progress goroutine).
func (w *world) dispatch(src int, m ctlMsg) {
	switch m.Kind {
	case ctlRTS:
		w.onRTS(src, m)
	case ctlCount:
		w.onCount(src, m)
	case ctlCTS, ctlNack, ctlStop:
		w.onSendCtl(src, m)
	}
}

// onRTS answers a sender's request to send into a receipt of this rank:
// the receipt claimed for it, or a nack that says why not.
func (w *world) onRTS(src int, m ctlMsg) {
	w.mu.Lock()
	t := w.transports[m.Transport]
	r := w.recvs[m.Receipt]
	w.mu.Unlock()
	switch {
	case t == nil:
		w.sendCtl(src, ctlMsg{Kind: ctlNack, Code: codeClosed, Receipt: m.Receipt, Send: m.Send})
	case r == nil || r.t != t || r.claimed || r.finished:
		w.sendCtl(src, ctlMsg{Kind: ctlNack, Code: codeGone, Receipt: m.Receipt, Send: m.Send})
	case int64(m.A) != r.total:
		w.sendCtl(src, ctlMsg{Kind: ctlNack, Code: codeSize, Receipt: m.Receipt, Send: m.Send})
	default:
		w.claim(r, src, m.Send)
	}
}

// onCount takes a sender's word of how many frames it posted for a
// receipt (an abort before the claim, a local count, or a Send that
// stopped: the frames after the count will not come).
func (w *world) onCount(src int, m ctlMsg) {
	w.mu.Lock()
	r := w.recvs[m.Receipt]
	w.mu.Unlock()
	if r == nil || (r.claimed && (r.src != src || r.sid != m.Send)) {
		return
	}
	switch {
	case !r.claimed:
		if m.Code == codeAbort {
			w.finish(r, fmt.Errorf("mpi: receipt %d: rank %d: %w", r.id, src, transport.ErrAborted))
		}
	case r.local:
		r.count, r.counted = m.A, true
		w.sinkIfCounted(r)
	default:
		// The sender stopped after m.A frames: the rest will not come.
		r.ending = fmt.Errorf("mpi: receipt %d: rank %d: %w", r.id, src, transport.ErrAborted)
		for i := int(min(m.A, uint64(len(r.frames)))); i < len(r.frames); i++ {
			if r.frames[i] >= 0 {
				w.cancelReq(r.frames[i])
			}
		}
		if r.pending == 0 {
			w.finish(r, r.ending)
		}
	}
}

// onSendCtl takes a receiver's answer about a Send of this rank: clear to
// send, a nack, or a stop.
func (w *world) onSendCtl(src int, m ctlMsg) {
	w.mu.Lock()
	s := w.sends[m.Send]
	w.mu.Unlock()
	if s == nil {
		if m.Kind == ctlStop {
			// That Send ended having posted every frame (or said
			// how many it posted in an earlier count).
			w.sendCtl(src, ctlMsg{Kind: ctlCount, Code: codeFin, Receipt: m.Receipt, Send: m.Send, A: allFrames})
		}
		return
	}
	if s.d.Rank != src || s.d.Receipt != m.Receipt {
		w.log.Warn("mpi: control message for a send from the wrong rank", "kind", m.Kind, "from", src)
		return
	}
	switch m.Kind {
	case ctlCTS:
		if s.cts || s.stopping != nil {
			return
		}
		fb := int(m.B)
		if fb <= 0 || fb > transport.MaxFrameBytes || m.A == 0 || m.A > uint64(w.tagUB) {
			w.stopSend(s, fmt.Errorf("%w: mpi: send to %s: cts with frame bytes %d, tag %d", transport.ErrProtocol, peerName(s.d), m.B, m.A))
			return
		}
		s.cts, s.tag, s.fb = true, int(m.A), fb
		s.frames = frameCount(s.d.Total, fb)
		w.postFrames(s)
		w.endSendIfDrained(s)
	case ctlNack:
		s.counted = true // the receipt was never claimed by s: nothing to count
		w.stopSend(s, nackError(s, m.Code))
	case ctlStop:
		err := fmt.Errorf("mpi: send to %s: %w", peerName(s.d), ErrReceiptGone)
		if m.Code == codeClosed {
			err = fmt.Errorf("mpi: send to %s: the receiving transport closed: %w", peerName(s.d), transport.ErrPeerLost)
		}
		if s.stopping == nil {
			s.stopping = err
		}
		if !s.counted {
			s.counted = true
			w.sendCtl(src, ctlMsg{Kind: ctlCount, Code: codeFin, Receipt: s.d.Receipt, Send: s.id, A: uint64(s.posted)})
		}
		w.endSendIfDrained(s)
	}
}

func nackError(s *send, code uint8) error {
	switch code {
	case codeClosed:
		return fmt.Errorf("mpi: send to %s: the receiving transport is closed: %w", peerName(s.d), transport.ErrPeerLost)
	case codeSize:
		return fmt.Errorf("%w: mpi: send to %s: the receipt expects another total", transport.ErrBadDescriptor, peerName(s.d))
	}
	return fmt.Errorf("mpi: send to %s: %w", peerName(s.d), ErrReceiptGone)
}

// Close fails the pending receipts (net.ErrClosed), stops the Sends in
// progress, and returns once MPI has let go of their memory. Idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		t.sending.Wait()
		return nil
	}
	t.closed = true
	close(t.closing)
	recvs := make([]*recv, 0, len(t.recvs))
	for _, r := range t.recvs {
		recvs = append(recvs, r)
	}
	t.mu.Unlock()
	w := t.w
	w.mu.Lock()
	delete(w.transports, t.id)
	w.mu.Unlock()
	w.do(func() {
		for _, r := range recvs {
			w.endLocal(r, fmt.Errorf("mpi: receipt %d: %w", r.id, &transport.ClosedError{Op: "receive"}), codeClosed)
		}
	})
	for _, r := range recvs {
		<-r.done
	}
	t.sending.Wait()
	t.log.Info("mpi: data plane closed", "endpoint", t.Endpoint())
	return nil
}
