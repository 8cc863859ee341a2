//go:build ucx && cgo

package ucx

/*
#cgo LDFLAGS: -lucp -lucs
#include <stdlib.h>
#include "kx.h"

static ucp_dt_iov_t *kx_iov_at(void *base, size_t i) { return (ucp_dt_iov_t *)base + i; }
*/
import "C"

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/transport"
)

// loop is the state of the progress goroutine: the only goroutine that
// calls into the UCP worker, one call at a time (the worker is created
// with UCS_THREAD_MODE_SERIALIZED: see the package documentation).
// Everything in it is touched only from that goroutine.
type loop struct {
	t       *Transport
	w       *C.kx_worker
	efd     *os.File // a dup of UCX's event fd, in Go's netpoller
	efdConn syscall.RawConn

	nextID     uint64
	reqs       map[uint64]*request
	peers      map[string]*peer // by raw endpoint
	peerByID   map[uint64]*peer
	peerByInst map[uint64]*peer
	recvs      map[uint64]*recv // pending, by tag base
	sends      map[uint64]*send // in flight, by id
	aborting   int              // sends with aborting set, not ended
	recent     recentSet        // receipts that completed, for abort answers
	ctrlLeft   int              // control sends in flight
	closesLeft int              // endpoint closes in flight
	tls        []string         // every transport seen, for Name
	tcpLane    bool             // a live endpoint has a tcp lane (noteLanes)

	readied   bool // a Send or receipt ended this round: its waiter is runnable
	closing   bool
	closeBy   time.Time
	byeSent   bool
	byeBy     time.Time
	finishing bool
}

// request is one UCP request of a receipt or a send.
type request struct {
	id  uint64
	req unsafe.Pointer
	r   *recv
	s   *send
	i   int // message index
}

// peer is a cached endpoint to another transport.
type peer struct {
	id     uint64
	key    string // raw endpoint
	inst   uint64
	name   string
	ep     C.ucp_ep_h
	epctx  unsafe.Pointer
	tls    []string
	sends  map[*send]struct{}
	failed bool
}

func (l *loop) newID() uint64 { l.nextID++; return l.nextID }

func (l *loop) wake() { C.kx_wake(l.w) }

func ucsString(st C.ucs_status_t) string { return C.GoString(C.ucs_status_string(st)) }

// run is the progress goroutine: it opens the worker and reports how that
// went on ready, then turns the loop until Close has finished with it, and
// shuts down.
func (t *Transport) run(ready chan<- error) {
	defer close(t.done)

	w := (*C.kx_worker)(C.calloc(1, C.size_t(unsafe.Sizeof(C.kx_worker{}))))
	defer C.free(unsafe.Pointer(w))
	l, err := t.newLoop(w)
	if err != nil {
		t.mu.Lock()
		t.stopped = true
		t.mu.Unlock()
		ready <- err
		return
	}
	t.lp = l
	ready <- nil
	l.turn()
	l.shutdown()
}

// newLoop opens the UCP context and worker in w with the backend's
// defaults, sets the Transport's endpoint from the worker's address, and
// readies the wait on the worker's event fd. On failure nothing is left
// open.
func (t *Transport) newLoop(w *C.kx_worker) (*loop, error) {
	l := &loop{
		t: t, w: w,
		reqs:       map[uint64]*request{},
		peers:      map[string]*peer{},
		peerByID:   map[uint64]*peer{},
		peerByInst: map[uint64]*peer{},
		recvs:      map[uint64]*recv{},
		sends:      map[uint64]*send{},
		recent:     newRecentSet(4096),
	}
	defs := defaultsFromEnv(t.bind)
	cdefs := C.CString(defs)
	st := C.kx_open(w, cdefs, C.size_t(len(defs)))
	C.free(unsafe.Pointer(cdefs))
	if st != C.UCS_OK {
		return nil, fmt.Errorf("ucx: open: %s", ucsString(st))
	}
	var addr unsafe.Pointer
	var alen C.size_t
	if st := C.kx_address(w, &addr, &alen); st != C.UCS_OK {
		C.kx_close(w)
		return nil, fmt.Errorf("ucx: worker address: %s", ucsString(st))
	}
	t.endpointRaw = encodeEndpoint(t.inst, C.GoBytes(addr, C.int(alen)))
	C.free(addr)
	t.endpoint = base64.StdEncoding.EncodeToString(t.endpointRaw)
	if err := l.initWait(); err != nil {
		C.kx_close(w)
		return nil, fmt.Errorf("ucx: wakeup fd: %w", err)
	}
	t.log.Debug("ucx: open", "instance", fmt.Sprintf("%016x", t.inst), "address_bytes", int(alen))
	return l, nil
}

// turn runs rounds (submitted operations, progress, events, stale
// messages, timers) until Close has finished with the loop. After 64
// rounds in a row with nothing to do it sleeps on the worker's event fd,
// unless keepSpinning says to go on polling.
func (l *loop) turn() {
	idle := 0
	var lastBusy time.Time
	for !l.finishing {
		busy := l.runQueue()
		if n := C.kx_progress(l.w, 64); n > 0 {
			busy = true
		}
		if l.handleEvents() {
			busy = true
		}
		if l.drainStale() {
			busy = true
			l.handleEvents()
		}
		now := time.Now()
		l.timers(now)
		if l.readied {
			// The goroutines that wait for what just ended were made
			// runnable on this P, behind this loop, which would keep it for
			// its next rounds: let them run first.
			l.readied = false
			runtime.Gosched()
		}
		if busy {
			idle, lastBusy = 0, now
			continue
		}
		if idle++; idle < 64 {
			continue
		}
		if keepSpinning(len(l.sends)+len(l.recvs) > 0, l.overTCP(), now.Sub(lastBusy)) {
			continue
		}
		l.t.sleeping.Store(true)
		if !l.queued() {
			l.sleep(l.sleepFor())
		}
		l.t.sleeping.Store(false)
	}
}

// spinFor is how long the progress goroutine polls on without progress,
// while a Send or receipt is in flight over shared memory, before it
// sleeps.
const spinFor = 2 * time.Millisecond

// keepSpinning reports whether the progress goroutine, idle for the last
// rounds, should poll on rather than sleep: only while a Send or receipt
// is in flight (inFlight), over no tcp lane, and for at most spinFor since
// the last round that did something. Over shared memory a transfer's
// steps (a rendezvous request, then the receiver's cma copies, then the
// acknowledgements) come in quick succession, and a sleep between them
// costs the wakeup of the goroutine and, on a virtual machine, of a halted
// CPU: measured with kvxfer bench (llama-3.1-8b, 4096 tokens, eight runs
// each, alternated), 8.11 GB/s on average sleeping, 8.88 spinning (7 of
// the 8 pairs faster). Over loopback tcp the spin takes the CPU the
// kernel's TCP stack needs and gained nothing (3.31 against 3.09 GB/s,
// seven pairs); measured again at 7935a42, UCX_TLS=tcp, 12 requests a run,
// four alternated pairs: 3.79, 4.35, 2.97, 2.99 GB/s sleeping, 2.77, 3.16,
// 3.89, 3.24 spinning (means 3.53 and 3.27).
func keepSpinning(inFlight, overTCP bool, sinceBusy time.Duration) bool {
	return inFlight && !overTCP && sinceBusy < spinFor
}

// overTCP reports whether an endpoint of this transport has a tcp lane:
// the flag that peer and failPeer keep (an idle round asks it, and walking
// the endpoints there took a tenth of a spinning sender's time).
func (l *loop) overTCP() bool { return l.tcpLane }

// noteLanes recomputes the flag overTCP reports, after an endpoint came or
// went.
func (l *loop) noteLanes() {
	l.tcpLane = false
	for _, p := range l.peerByID {
		if slices.Contains(p.tls, "tcp") {
			l.tcpLane = true
			return
		}
	}
}

// initWait wraps a dup of UCX's event fd (an epoll fd, readable when the
// worker has events, ucp_worker_signal included) in an os.File, so that
// the progress goroutine sleeps in Go's netpoller: a goroutine blocked in
// a C call keeps its P until sysmon takes it back, which starves every
// other goroutine (Send callers, waiters on Done) for up to milliseconds
// on a machine with few cores.
func (l *loop) initWait() error {
	fd, err := syscall.Dup(int(l.w.efd))
	if err != nil {
		return err
	}
	syscall.CloseOnExec(fd)
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return err
	}
	l.efd = os.NewFile(uintptr(fd), "ucx-efd")
	rc, err := l.efd.SyscallConn()
	if err != nil {
		l.efd.Close()
		return err
	}
	l.efdConn = rc
	return nil
}

// sleep arms the worker and waits, at most d, for its event fd.
func (l *loop) sleep(d time.Duration) {
	switch C.kx_arm(l.w) {
	case 1: // events pending
		return
	case -1: // cannot arm: nap instead
		time.Sleep(min(d, time.Millisecond))
		return
	}
	if err := l.efd.SetReadDeadline(time.Now().Add(d)); err != nil {
		time.Sleep(min(d, time.Millisecond))
		return
	}
	first := true
	// Read forgets a readiness the netpoller saw before it (prepareRead),
	// then calls the function, then, while it returns false, waits for the
	// fd to turn readable (or the deadline). So the first call checks the
	// fd itself: an event that came between arming and Read has left it
	// readable, one that comes later wakes the wait.
	_ = l.efdConn.Read(func(fd uintptr) bool {
		if first {
			first = false
			return C.kx_readable(C.int(fd)) != 0
		}
		return true
	})
}

func (l *loop) queued() bool {
	l.t.mu.Lock()
	defer l.t.mu.Unlock()
	return len(l.t.queue) > 0
}

// drainStale receives, into scratch memory, every unexpected tagged
// message: its receipt has ended (completed, cancelled, failed), or never
// existed (a bogus descriptor), since receives are posted before their tag
// is known. Truncation completes the sender (a rendezvous gets its ack).
// A message for a receipt submitted but not yet posted stops the drain
// until the next round, when the receive has been posted and takes it.
func (l *loop) drainStale() bool {
	n := 0
	for {
		// The tag comes back in the worker's C memory: a pointer to a Go
		// variable would move it to the heap and be checked, every round.
		if C.kx_unexpected_tag(l.w) == 0 || l.t.isPending(uint64(l.w.probe_tag)&^indexMask) {
			return n > 0
		}
		C.kx_drain_one(l.w)
		n++
	}
}

// runQueue runs the submitted operations.
func (l *loop) runQueue() bool {
	l.t.mu.Lock()
	q := l.t.queue
	l.t.queue = nil
	l.t.mu.Unlock()
	for _, f := range q {
		f()
		// An operation may have completed requests (cancel, force close):
		// handle them before the next touches any request.
		l.handleEvents()
	}
	return len(q) > 0
}

func (l *loop) sleepFor() time.Duration {
	d := idleWake
	now := time.Now()
	if l.closing {
		d = 10 * time.Millisecond
	}
	for _, s := range l.sends {
		if s.aborting != nil {
			d = min(d, max(s.deadline.Sub(now), time.Millisecond))
		}
	}
	return max(d, time.Millisecond)
}

// ---- events -----------------------------------------------------------

type event struct {
	kind   int
	id     uint64
	length uint64
	req    unsafe.Pointer
	status C.ucs_status_t
	data   []byte
}

// handleEvents handles what UCX reported since the last call; reports
// whether there was anything.
func (l *loop) handleEvents() bool {
	any := false
	for {
		// Read from the worker's C memory directly: no C call (and no Go
		// variable passed to C, which would go to the heap) in the common
		// case of nothing new. Only this goroutine runs UCX's callbacks,
		// inside its own C calls, so nothing writes the list meanwhile.
		n := l.w.nev
		if n == 0 {
			return any
		}
		any = true
		raw := unsafe.Slice(l.w.ev, int(n))
		evs := make([]event, len(raw))
		for i, e := range raw {
			evs[i] = event{kind: int(e.kind), id: uint64(e.id), length: uint64(e.len), req: e.req, status: C.ucs_status_t(e.status)}
			if e.kind == C.KX_EV_AM && e.data != nil {
				evs[i].data = C.GoBytes(e.data, C.int(e.len))
			}
		}
		C.kx_events_clear(l.w)
		for _, e := range evs {
			l.handle(e)
		}
	}
}

func (l *loop) handle(e event) {
	switch e.kind {
	case C.KX_EV_SEND, C.KX_EV_RECV:
		if e.req != nil {
			C.ucp_request_free(e.req)
		}
		q := l.reqs[e.id]
		if q == nil {
			return
		}
		delete(l.reqs, e.id)
		q.req = nil
		if q.r != nil {
			l.recvEnded(q, e.status, e.length)
		} else {
			l.sendEnded(q, e.status)
		}
	case C.KX_EV_CTRL:
		l.ctrlLeft--
	case C.KX_EV_CLOSE:
		l.closesLeft--
	case C.KX_EV_EPERR:
		if p := l.peerByID[e.id]; p != nil {
			l.failPeer(p, fmt.Errorf("ucx: peer %s: %w (%s)", p.name, transport.ErrPeerLost, ucsString(e.status)))
		}
	case C.KX_EV_AM:
		m, err := decodeCtrl(e.data)
		if err != nil {
			l.t.log.Warn("ucx: dropped a control message", "err", err)
			return
		}
		l.control(m)
	case C.KX_EV_DRAIN:
		l.t.log.Debug("ucx: dropped a message for no pending receipt", "bytes", e.length)
	}
}

// ---- receipts ---------------------------------------------------------

// post posts r's receives (from Expect). A failure to post fails r.
func (l *loop) post(r *recv) {
	defer l.t.posted(r.tagBase)
	if l.closing {
		l.endRecv(r, &transport.ClosedError{Op: "expect"})
		return
	}
	if l.recvs[r.tagBase] != nil { // 48 random bits collided
		l.endRecv(r, errors.New("ucx: expect: tag collision"))
		return
	}
	l.recvs[r.tagBase] = r
	r.reqs = make([]*request, len(r.bufs))
	for i, b := range r.bufs {
		q := &request{id: l.newID(), r: r, i: i}
		var req unsafe.Pointer
		st := C.kx_tag_recv(l.w, C.uint64_t(r.tagBase|uint64(i)), b.ptr, C.size_t(b.len), C.size_t(b.iovcnt), C.uint64_t(q.id), &req)
		if st == C.UCS_INPROGRESS {
			q.req = req
			r.reqs[i] = q
		}
		if st == C.UCS_INPROGRESS || st == C.UCS_OK { // OK: an event reports it
			l.reqs[q.id] = q
			r.left++
			continue
		}
		r.fail = fmt.Errorf("ucx: expect: posting a receive: %s", ucsString(st))
		break
	}
	r.posted = true
	if r.fail != nil {
		l.failRecv(r, r.fail)
	}
}

// endRecv ends r with err (nil: success) once UCX has let go of its memory.
func (l *loop) endRecv(r *recv, err error) {
	r.mem.release()
	r.End(err)
	l.readied = true
}

// failRecv fails r with why (unless it has a reason already) and cancels
// its receives; r ends when UCX has ended every one of them.
func (l *loop) failRecv(r *recv, why error) {
	if l.recvs[r.tagBase] != r {
		return // ended
	}
	if r.fail == nil {
		r.fail = why
	}
	for _, q := range r.reqs {
		if q != nil && q.req != nil {
			C.kx_cancel(l.w, q.req)
		}
	}
	l.maybeEndRecv(r)
}

func (l *loop) recvEnded(q *request, st C.ucs_status_t, length uint64) {
	r := q.r
	r.reqs[q.i] = nil
	r.left--
	switch {
	case st == C.UCS_OK && int64(length) != r.lens[q.i]:
		l.failRecv(r, fmt.Errorf("ucx: %w: message %d of %d bytes, want %d", transport.ErrProtocol, q.i, length, r.lens[q.i]))
	case st == C.UCS_ERR_MESSAGE_TRUNCATED:
		l.failRecv(r, fmt.Errorf("ucx: %w: message %d longer than its %d bytes", transport.ErrProtocol, q.i, r.lens[q.i]))
	case st == C.UCS_ERR_CANCELED && r.fail != nil:
	case st != C.UCS_OK:
		l.failRecv(r, fmt.Errorf("ucx: receive: %w (%s)", transport.ErrPeerLost, ucsString(st)))
	}
	l.maybeEndRecv(r)
}

func (l *loop) maybeEndRecv(r *recv) {
	if r.left > 0 || !r.posted || l.recvs[r.tagBase] != r {
		return
	}
	delete(l.recvs, r.tagBase)
	l.recent.add(r.tagBase, r.fail == nil)
	l.endRecv(r, r.fail)
}

// ---- sends ------------------------------------------------------------

// startSend connects (or reuses the endpoint) and posts s's messages.
func (l *loop) startSend(s *send, d *descriptor) {
	s.id = l.newID()
	if l.closing {
		l.endSend(s, &transport.ClosedError{Op: "send"})
		return
	}
	p, err := l.peer(d.endpoint)
	if err != nil {
		l.endSend(s, err)
		return
	}
	s.peer = p
	p.sends[s] = struct{}{}
	l.sends[s.id] = s
	s.reqs = make([]*request, len(s.bufs))
	for i, b := range s.bufs {
		q := &request{id: l.newID(), s: s, i: i}
		var req unsafe.Pointer
		st := C.kx_tag_send(l.w, p.ep, C.uint64_t(s.tagBase|uint64(i)), b.ptr, C.size_t(b.len), C.size_t(b.iovcnt), C.uint64_t(q.id), &req)
		if st == C.UCS_INPROGRESS {
			q.req = req
			s.reqs[i] = q
			l.reqs[q.id] = q
			s.left++
			continue
		}
		if st != C.UCS_OK {
			// The receipt now misses messages: abort it.
			s.fail = fmt.Errorf("ucx: send to %s: %w (%s)", p.name, transport.ErrPeerLost, ucsString(st))
			l.abortSend(s, s.fail, abortGrace)
			return
		}
	}
	l.maybeEndSend(s)
}

func (l *loop) sendEnded(q *request, st C.ucs_status_t) {
	s := q.s
	s.reqs[q.i] = nil
	s.left--
	if st != C.UCS_OK && s.fail == nil {
		s.fail = fmt.Errorf("ucx: send to %s: %w (%s)", s.peer.name, transport.ErrPeerLost, ucsString(st))
	}
	l.maybeEndSend(s)
}

// abortSend stops s early: the receiver is told (ABORT) and answers with
// what became of its receipt; s ends when UCX has ended every message and
// the answer is in, or the peer is lost, or grace has passed (then the
// endpoint is closed by force).
func (l *loop) abortSend(s *send, why error, grace time.Duration) {
	if s.ended || s.aborting != nil {
		return
	}
	s.aborting = why
	l.aborting++
	s.deadline = time.Now().Add(grace)
	if s.peer == nil || s.peer.failed {
		l.maybeEndSend(s)
		return
	}
	l.ctrl(s.peer, &ctrlMsg{typ: ctrlAbort, a: s.tagBase, b: s.id})
	l.maybeEndSend(s)
}

// abortOnly tells a receiver that a Send whose ctx had ended will send
// nothing.
func (l *loop) abortOnly(d *descriptor) {
	if l.closing {
		return
	}
	if p, err := l.peer(d.endpoint); err == nil {
		l.ctrl(p, &ctrlMsg{typ: ctrlAbort, a: d.tagBase})
	}
}

func (l *loop) maybeEndSend(s *send) {
	if s.ended || s.left > 0 {
		return
	}
	var err error
	switch {
	case s.aborting == nil:
		err = s.fail
	case s.ack == 0 && !s.peer.failed && time.Now().Before(s.deadline):
		return // wait for the receiver's answer
	case s.ack == ackCompleted && s.fail == nil:
		err = nil // every byte was in place before the abort
	default:
		err = s.aborting
	}
	l.endSend(s, err)
}

func (l *loop) endSend(s *send, err error) {
	s.ended = true
	if s.aborting != nil {
		l.aborting--
	}
	delete(l.sends, s.id)
	if s.peer != nil {
		delete(s.peer.sends, s)
	}
	s.err = err
	close(s.done)
	l.readied = true
}

// timers fails the endpoints of aborted sends whose grace has passed and
// advances Close. Every round calls it: it walks the sends only while one
// is aborting.
func (l *loop) timers(now time.Time) {
	if l.aborting > 0 {
		l.abortTimers(now)
	}
	if l.closing {
		l.closeStep(now)
	}
}

func (l *loop) abortTimers(now time.Time) {
	for _, s := range l.sends {
		if s.aborting == nil || now.Before(s.deadline) {
			continue
		}
		if s.left == 0 {
			l.maybeEndSend(s)
			continue
		}
		if p := s.peer; p != nil && !p.failed {
			l.t.log.Warn("ucx: peer did not settle an aborted send in time; closing the endpoint", "peer", p.name)
			// The ABORTs queued on the endpoint go with it: a receiver
			// that stalled before the endpoint was wired up (a paused
			// process) has seen none of them, and would keep the receipts
			// of these sends armed until its own deadline.
			var tags []uint64
			for o := range p.sends {
				if !o.ended && o.ack == 0 {
					tags = append(tags, o.tagBase)
				}
			}
			l.failPeer(p, fmt.Errorf("ucx: peer %s: %w (no answer to abort)", p.name, transport.ErrPeerLost))
			l.abortAgain(p.key, tags)
		}
	}
}

// abortAgain queues an ABORT for each of tags on a fresh endpoint to the
// transport at ep (raw), for sends whose endpoint was closed by force
// before the receiver answered. UCX holds the messages until the receiver
// wires the endpoint up, so one that stalled gets them when it runs again
// and fails the receipts; one that died fails the endpoint (keepalive),
// and Close closes it by force.
func (l *loop) abortAgain(ep string, tags []uint64) {
	if l.closing || len(tags) == 0 {
		return
	}
	p, err := l.peer([]byte(ep))
	if err != nil {
		l.t.log.Debug("ucx: cannot reconnect to deliver aborts", "peer", peerName([]byte(ep)), "err", err)
		return
	}
	for _, tag := range tags {
		if p.failed {
			return
		}
		l.ctrl(p, &ctrlMsg{typ: ctrlAbort, a: tag})
	}
}

// ---- peers and control ------------------------------------------------

// peer returns the endpoint to the transport at ep (raw), connecting on
// first use.
func (l *loop) peer(ep []byte) (*peer, error) {
	if p := l.peers[string(ep)]; p != nil {
		return p, nil
	}
	inst, addr, err := parseEndpoint(ep)
	if err != nil {
		return nil, fmt.Errorf("%w: ucx: %v", transport.ErrBadDescriptor, err)
	}
	p := &peer{id: l.newID(), key: string(ep), inst: inst, name: peerName(ep), sends: map[*send]struct{}{}}
	caddr := C.CBytes(addr)
	defer C.free(caddr)
	st := C.kx_ep_create(l.w, caddr, C.uint64_t(p.id), &p.ep, &p.epctx)
	if st != C.UCS_OK {
		return nil, fmt.Errorf("ucx: connect to %s: %w (%s)", p.name, transport.ErrPeerLost, ucsString(st))
	}
	l.peers[p.key] = p
	l.peerByID[p.id] = p
	l.peerByInst[p.inst] = p
	p.tls = epTransports(p.ep)
	l.noteTransports(p)
	l.noteLanes()
	l.ctrl(p, &ctrlMsg{typ: ctrlHello, payload: l.t.endpointRaw})
	if p.failed { // the hello could not even be queued
		return nil, fmt.Errorf("ucx: connect to %s: %w", p.name, transport.ErrPeerLost)
	}
	return p, nil
}

// epTransports reads the transports of an endpoint's lanes from
// ucp_ep_print_info (UCX 1.13 has no ucp_ep_query field for them).
func epTransports(ep C.ucp_ep_h) []string {
	info := C.kx_ep_info(ep)
	if info == nil {
		return nil
	}
	defer C.free(unsafe.Pointer(info))
	return parseLanes(C.GoString(info))
}

func (l *loop) noteTransports(p *peer) {
	changed := false
	for _, tl := range p.tls {
		if !slices.Contains(l.tls, tl) {
			l.tls = append(l.tls, tl)
			changed = true
		}
	}
	if changed {
		name := "ucx(" + strings.Join(l.tls, ",") + ")"
		l.t.name.Store(&name)
	}
	l.t.log.Info("ucx: connected", "peer", p.name, "transports", strings.Join(p.tls, ","))
}

// ctrl sends a control message to p; a failure to send fails p.
func (l *loop) ctrl(p *peer, m *ctrlMsg) {
	m.inst = l.t.inst
	b := m.encode()
	st := C.kx_ctrl_send(l.w, p.ep, unsafe.Pointer(&b[0]), C.size_t(len(b)), 0)
	switch st {
	case C.UCS_INPROGRESS:
		l.ctrlLeft++
	case C.UCS_OK:
	default:
		l.failPeer(p, fmt.Errorf("ucx: peer %s: %w (%s)", p.name, transport.ErrPeerLost, ucsString(st)))
	}
}

func (l *loop) control(m *ctrlMsg) {
	switch m.typ {
	case ctrlHello:
		// Connect back: acks and the goodbye travel on our own endpoint.
		if l.closing {
			return
		}
		if _, err := l.peer(m.payload); err != nil {
			l.t.log.Debug("ucx: cannot connect back to a peer", "peer", peerName(m.payload), "err", err)
		}
	case ctrlBye:
		if p := l.peerByInst[m.inst]; p != nil {
			l.failPeer(p, fmt.Errorf("ucx: peer %s: %w (it closed its transport)", p.name, transport.ErrPeerLost))
		}
	case ctrlAbort:
		ans := uint64(ackAborted)
		if r := l.recvs[m.a]; r != nil {
			l.failRecv(r, fmt.Errorf("ucx: %w", transport.ErrAborted))
		} else if l.recent.completed(m.a) {
			ans = ackCompleted
		}
		if m.b != 0 {
			if p := l.peerByInst[m.inst]; p != nil && !p.failed {
				l.ctrl(p, &ctrlMsg{typ: ctrlAck, a: m.b, b: ans})
			}
		}
	case ctrlAck:
		if s := l.sends[m.a]; s != nil && s.peer != nil && s.peer.inst == m.inst && s.aborting != nil {
			s.ack = m.b
			l.maybeEndSend(s)
		}
	}
}

// failPeer forgets p and closes its endpoint by force: UCX ends its
// requests with UCS_ERR_CANCELED, which fails the sends on it with why.
func (l *loop) failPeer(p *peer, why error) {
	if p.failed {
		return
	}
	if !l.finishing {
		l.t.log.Info("ucx: peer lost", "peer", p.name, "err", why)
	}
	p.failed = true
	delete(l.peers, p.key)
	delete(l.peerByID, p.id)
	if l.peerByInst[p.inst] == p {
		delete(l.peerByInst, p.inst)
	}
	l.noteLanes()
	for s := range p.sends {
		if s.fail == nil {
			s.fail = why
		}
	}
	if C.kx_ep_close_force(l.w, p.ep, p.epctx, C.uint64_t(p.id)) == 1 {
		l.closesLeft++
	}
	p.epctx = nil
	for s := range p.sends {
		l.maybeEndSend(s)
	}
}

// ---- close ------------------------------------------------------------

func (l *loop) beginClose() {
	if l.closing {
		return
	}
	l.closing = true
	l.closeBy = time.Now().Add(closeGrace)
	for _, s := range l.sends {
		l.abortSend(s, &transport.ClosedError{Op: "send"}, closeGrace)
	}
	for _, r := range l.recvs {
		l.failRecv(r, &transport.ClosedError{Op: "receive"})
	}
	l.closeStep(time.Now())
}

// closeStep advances Close: in-flight work settles (or closeGrace passes),
// then goodbye to every peer, then (once sent, or after a second) the
// endpoints close and the loop ends.
func (l *loop) closeStep(now time.Time) {
	if !l.byeSent {
		if (len(l.sends) > 0 || len(l.recvs) > 0) && now.Before(l.closeBy) {
			return
		}
		l.byeSent = true
		l.byeBy = now.Add(time.Second)
		for _, p := range l.peers {
			l.ctrl(p, &ctrlMsg{typ: ctrlBye})
		}
	}
	if l.ctrlLeft > 0 && now.Before(l.byeBy) {
		return
	}
	l.finishing = true
}

// shutdown closes endpoints, worker and context, and ends whatever is left.
func (l *loop) shutdown() {
	for _, p := range l.peers {
		l.failPeer(p, &transport.ClosedError{Op: "close"})
	}
	deadline := time.Now().Add(time.Second)
	for l.closesLeft > 0 && time.Now().Before(deadline) {
		C.kx_progress(l.w, 64)
		l.handleEvents()
	}
	l.handleEvents()
	// Free the requests UCX still holds for us before the worker goes.
	for _, q := range l.reqs {
		if q.req != nil {
			C.ucp_request_free(q.req)
			q.req = nil
		}
	}
	// No more wakes (ucp_worker_signal) once the worker is gone.
	l.t.mu.Lock()
	l.t.stopped = true
	q := l.t.queue
	l.t.queue = nil
	l.t.mu.Unlock()
	l.efd.Close()
	C.kx_close(l.w) // after this UCX touches no memory of ours
	for _, s := range l.sends {
		if s.aborting != nil {
			l.endSend(s, s.aborting)
		} else {
			l.endSend(s, &transport.ClosedError{Op: "send"})
		}
	}
	for _, r := range l.recvs {
		delete(l.recvs, r.tagBase)
		if r.fail == nil {
			r.fail = &transport.ClosedError{Op: "receive"}
		}
		l.endRecv(r, r.fail)
	}
	// Operations submitted while the loop went away: closing makes each of
	// them fail at once.
	for _, f := range q {
		f()
	}
}

// ---- memory -----------------------------------------------------------

// prepare pins the pieces of one message and describes them for UCP.
func (m *pinned) prepare(pieces [][]byte) msgBuf {
	var nonEmpty [][]byte
	var n int64
	for _, p := range pieces {
		if len(p) > 0 {
			nonEmpty = append(nonEmpty, p)
			n += int64(len(p))
		}
	}
	for _, p := range nonEmpty {
		m.pin.Pin(&p[0])
	}
	if len(nonEmpty) == 1 {
		p := nonEmpty[0]
		return msgBuf{ptr: unsafe.Pointer(&p[0]), len: uintptr(len(p)), bytes: n}
	}
	arr := C.malloc(C.size_t(len(nonEmpty)) * C.size_t(unsafe.Sizeof(C.ucp_dt_iov_t{})))
	for i, p := range nonEmpty {
		e := C.kx_iov_at(arr, C.size_t(i))
		e.buffer = unsafe.Pointer(&p[0])
		e.length = C.size_t(len(p))
	}
	m.iovs = append(m.iovs, arr)
	return msgBuf{ptr: arr, iovcnt: len(nonEmpty), bytes: n}
}

// release unpins and frees; only once UCX is done with the memory.
func (m *pinned) release() {
	for _, p := range m.iovs {
		C.free(p)
	}
	m.iovs = nil
	m.pin.Unpin()
}

// recentSet remembers, for a bounded number of receipts, whether each
// completed with every byte in place.
type recentSet struct {
	ok   map[uint64]bool
	ring []uint64
	next int
}

func newRecentSet(n int) recentSet {
	return recentSet{ok: make(map[uint64]bool, n), ring: make([]uint64, 0, n)}
}

func (s *recentSet) add(tag uint64, ok bool) {
	if len(s.ring) < cap(s.ring) {
		s.ring = append(s.ring, tag)
	} else {
		delete(s.ok, s.ring[s.next])
		s.ring[s.next] = tag
		s.next = (s.next + 1) % len(s.ring)
	}
	s.ok[tag] = ok
}

func (s *recentSet) completed(tag uint64) bool { return s.ok[tag] }
