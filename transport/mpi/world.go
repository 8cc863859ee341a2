//go:build mpi && cgo

package mpi

/*
#cgo pkg-config: ompi
#include <stdlib.h>
#include "kxmpi.h"
*/
import "C"

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/transport"
)

func init() { transport.RegisterOpen("mpi", Open) }

// Timing of the progress goroutine.
const (
	// hotSpin is how long the goroutine keeps spinning (in C, see
	// progress) after its last piece of work (a completion, a command, a
	// receipt armed): the control messages of a transfer (rts, cts) come
	// in quick succession, and a goroutine asleep would see each one a
	// nap late.
	hotSpin = 2 * time.Millisecond
	// spinSlice bounds one spinning cgo call (progress), so that the
	// goroutine comes back to Go to see a stop.
	spinSlice = time.Millisecond
	// waitNap and idleNap bound a sleep of the goroutine once it is
	// cold: with receipts armed or Sends waiting for their receiver (a
	// control message may come); with neither.
	waitNap = 250 * time.Microsecond
	idleNap = 2 * time.Millisecond
	// standingCtl is the number of control receives kept posted.
	standingCtl = 16
)

// world is the process's MPI world: its two communicators (data and
// control, duplicates of MPI_COMM_WORLD) and the goroutine that makes
// progress on them. Every MPI call after Init is made by that goroutine.
type world struct {
	rank, size int
	tagUB      int
	epoch      uint64
	data, ctl  C.MPI_Comm
	log        *slog.Logger

	mu         sync.Mutex
	cmds       []func()
	transports map[uint32]*Transport
	recvs      map[uint64]*recv // armed, claimed, or ended but not yet counted
	sends      map[uint64]*send
	nextTID    uint32
	nextRID    uint64
	nextSID    uint64
	wake       chan struct{}
	idle       *time.Timer // progress's wait with nothing posted (the progress goroutine's; nil until first used)
	bell       *C.int      // the doorbell: nonzero when cmds (or a poke) wait; C memory, so that a spinning progress sees it
	stop       chan struct{}
	stopped    chan struct{}
	finalErr   error // MPI_Finalize's, set before stopped closes

	// Owned by the progress goroutine.
	reqs     []C.MPI_Request
	handlers []func(st completion)
	freeSlot []int
	active   int // slots in use
	inRecv   int // of them, data receives
	inSend   int // of them, data sends
	indices  []C.int
	statuses []C.MPI_Status
	done     []completed // testsome's, reused
	nextTag  int
}

// completed is a finished request's handler and what it reports.
type completed struct {
	h func(completion)
	c completion
}

// completion is what a finished request reports.
type completion struct {
	Source    int
	Count     int
	Cancelled bool
	Err       error
}

var the struct {
	mu    sync.Mutex
	w     *world
	final bool
}

// Init initialises MPI at MPI_THREAD_MULTIPLE, duplicates MPI_COMM_WORLD
// twice (the data and the control communicators) and starts the world's
// progress goroutine, which Finalize stops. Every rank of the world must
// call it (MPI_Comm_dup is collective), once; a second call returns nil.
// logger receives the world's logs (nil: discarded). Init fails with
// ErrThreadLevel when the library cannot provide MPI_THREAD_MULTIPLE.
func Init(logger *slog.Logger) error {
	the.mu.Lock()
	defer the.mu.Unlock()
	if the.w != nil {
		return nil
	}
	if the.final {
		return fmt.Errorf("mpi: init: %w", ErrFinalized)
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	w := &world{
		log:        logger,
		transports: map[uint32]*Transport{},
		recvs:      map[uint64]*recv{},
		sends:      map[uint64]*send{},
		wake:       make(chan struct{}, 1),
		bell:       (*C.int)(C.calloc(1, C.size_t(unsafe.Sizeof(C.int(0))))),
		stop:       make(chan struct{}),
		stopped:    make(chan struct{}),
	}
	// The progress goroutine initialises MPI on its locked OS thread, and
	// finalizes it there: MPI wants MPI_Finalize on the thread that
	// initialised it.
	ready := make(chan error, 1)
	go w.run(ready)
	if err := <-ready; err != nil {
		C.free(unsafe.Pointer(w.bell))
		return err
	}
	the.w = w
	logger.Info("mpi: world initialised", "rank", w.rank, "size", w.size, "tag_ub", w.tagUB,
		"note", "a rank that dies takes the whole MPI world down")
	return nil
}

// Finalize stops the world's progress goroutine and calls MPI_Finalize.
// Every Transport must be closed first. MPI cannot be initialised again in
// the process. Idempotent.
func Finalize() error {
	the.mu.Lock()
	defer the.mu.Unlock()
	w := the.w
	if w == nil {
		return nil
	}
	w.mu.Lock()
	open := len(w.transports)
	w.mu.Unlock()
	if open > 0 {
		return fmt.Errorf("mpi: finalize: %d transports still open", open)
	}
	close(w.stop)
	w.poke()
	<-w.stopped
	C.free(unsafe.Pointer(w.bell))
	the.w, the.final = nil, true
	return w.finalErr
}

// Abort takes the whole MPI world down (MPI_Abort on MPI_COMM_WORLD):
// mpirun ends every rank with code. A rank that cannot go on calls it so
// that the others do not wait for it (in MPI_Finalize, or for its data).
// Without Init it exits the process with code.
func Abort(code int) {
	the.mu.Lock()
	w := the.w
	the.mu.Unlock()
	if w == nil {
		os.Exit(code)
	}
	C.kxm_abort(C.int(code))
}

// World reports this process's world rank and size; ok is false before
// Init.
func World() (rank, size int, ok bool) {
	the.mu.Lock()
	defer the.mu.Unlock()
	if the.w == nil {
		return 0, 0, false
	}
	return the.w.rank, the.w.size, true
}

func current() (*world, error) {
	the.mu.Lock()
	defer the.mu.Unlock()
	if the.w == nil {
		return nil, ErrNotInitialised
	}
	return the.w, nil
}

// do queues fn for the progress goroutine.
func (w *world) do(fn func()) {
	w.mu.Lock()
	w.cmds = append(w.cmds, fn)
	w.mu.Unlock()
	w.poke()
}

// poke rings the doorbell: a spinning progress goroutine returns from C,
// a sleeping one wakes, and either counts it as work (it spins hotSpin
// longer). Expect pokes so that the rts that follows is seen at once.
func (w *world) poke() {
	atomic.StoreInt32(w.bellWord(), 1)
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// bellWord is the doorbell as Go's atomics see it.
func (w *world) bellWord() *int32 { return (*int32)(unsafe.Pointer(w.bell)) }

// start initialises MPI and the world's communicators (progress
// goroutine, before its loop).
func (w *world) start() error {
	var provided C.int
	if rc := C.kxm_init(&provided); rc != 0 {
		return mpiErr("MPI_Init_thread", rc)
	}
	if provided < C.MPI_THREAD_MULTIPLE {
		return fmt.Errorf("mpi: init: %w (the library provides level %d; OpenMPI must be built with thread support)", ErrThreadLevel, int(provided))
	}
	var rank, size, tagUB C.int
	var epoch C.ulonglong
	if rc := C.kxm_setup(&w.data, &w.ctl, &rank, &size, &tagUB, &epoch); rc != 0 {
		return mpiErr("MPI_Comm_dup", rc)
	}
	w.rank, w.size, w.tagUB, w.epoch = int(rank), int(size), int(tagUB), uint64(epoch)
	return nil
}

// run is the progress goroutine: it initialises MPI, makes progress until
// Finalize, and finalizes MPI.
func (w *world) run(ready chan<- error) {
	defer close(w.stopped)
	// The thread stays locked to the end: MPI keeps thread-local state.
	runtime.LockOSThread()
	if err := w.start(); err != nil {
		ready <- err
		return
	}
	defer func() {
		if rc := C.kxm_finalize(&w.data, &w.ctl); rc != 0 {
			w.finalErr = mpiErr("MPI_Finalize", rc)
		}
	}()
	ctlBufs := make([]unsafe.Pointer, standingCtl)
	for i := range ctlBufs {
		ctlBufs[i] = C.malloc(ctlLen)
		if err := w.postCtlRecv(ctlBufs[i]); err != nil {
			ready <- err
			return
		}
	}
	ready <- nil
	nap := time.NewTimer(time.Hour)
	defer nap.Stop()
	var hotUntil time.Time
	var cmds []func()
	for {
		rung := atomic.SwapInt32(w.bellWord(), 0) != 0
		w.mu.Lock()
		cmds, w.cmds = w.cmds, cmds[:0]
		w.mu.Unlock()
		for _, fn := range cmds {
			fn()
		}
		clear(cmds)
		n := w.testsome()
		if rung || n > 0 {
			hotUntil = time.Now().Add(hotSpin)
			continue
		}
		select {
		case <-w.stop:
			w.shutdown(ctlBufs)
			return
		default:
		}
		// Data in flight, or work a moment ago: wait in C until a
		// request completes or the doorbell rings.
		if w.inRecv > 0 || w.inSend > 0 || time.Now().Before(hotUntil) {
			if w.progress(spinSlice, w.waitNap()) > 0 {
				hotUntil = time.Now().Add(hotSpin)
			}
			continue
		}
		d := idleNap
		w.mu.Lock()
		waiting := len(w.recvs)+len(w.sends) > 0
		w.mu.Unlock()
		if waiting {
			d = waitNap
		}
		nap.Reset(d)
		select {
		case <-w.wake:
		case <-nap.C:
		case <-w.stop:
		}
		if !nap.Stop() {
			select {
			case <-nap.C:
			default:
			}
		}
	}
}

// shutdown cancels the standing control receives and waits for them.
func (w *world) shutdown(ctlBufs []unsafe.Pointer) {
	for i := range w.reqs {
		if w.handlers[i] != nil {
			C.kxm_cancel(&w.reqs[i])
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for w.active > 0 && time.Now().Before(deadline) {
		if w.testsome() == 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	if w.active == 0 {
		for _, p := range ctlBufs {
			C.free(p)
		}
	}
}

// Kinds of request slots: the goroutine waits in C while data requests
// are active (see waitNap).
const (
	slotCtl = iota
	slotRecv
	slotSend
)

// slot reserves a request slot of kind for h.
func (w *world) slot(h func(completion), kind int) int {
	var i int
	if n := len(w.freeSlot); n > 0 {
		i = w.freeSlot[n-1]
		w.freeSlot = w.freeSlot[:n-1]
	} else {
		i = len(w.reqs)
		w.reqs = append(w.reqs, nil)
		C.kxm_request_null(&w.reqs[i])
		w.handlers = append(w.handlers, nil)
		w.indices = append(w.indices, 0)
		w.statuses = append(w.statuses, C.MPI_Status{})
	}
	switch kind {
	case slotRecv:
		w.inRecv++
		h = w.counted(&w.inRecv, h)
	case slotSend:
		w.inSend++
		h = w.counted(&w.inSend, h)
	}
	w.handlers[i] = h
	w.active++
	return i
}

// counted wraps h so that it first takes its request off *n.
func (w *world) counted(n *int, h func(completion)) func(completion) {
	return func(c completion) { *n--; h(c) }
}

// unslot returns slot i, of kind, after a failed post.
func (w *world) unslot(i int, kind int) {
	w.handlers[i] = nil
	C.kxm_request_null(&w.reqs[i])
	w.freeSlot = append(w.freeSlot, i)
	w.active--
	switch kind {
	case slotRecv:
		w.inRecv--
	case slotSend:
		w.inSend--
	}
}

// waitNap is how the goroutine waits between two tests in C now: see
// waitNapFor.
func (w *world) waitNap() time.Duration {
	if w.inRecv > 0 || w.inSend == 0 {
		return waitNapFor(w.inRecv, w.inSend, false)
	}
	awaiting := false
	w.mu.Lock()
	for _, s := range w.sends {
		if s.started && !s.cts && s.stopping == nil {
			awaiting = true
			break
		}
	}
	w.mu.Unlock()
	return waitNapFor(w.inRecv, w.inSend, awaiting)
}

// testsome tests every posted request once and runs the handlers of those
// that completed; it returns how many did.
func (w *world) testsome() int {
	if w.active == 0 {
		return 0
	}
	var out C.int
	rc := C.kxm_testsome(C.int(len(w.reqs)), &w.reqs[0], &out, &w.indices[0], &w.statuses[0])
	return w.complete(rc, out, "MPI_Testsome")
}

// progress waits in C (kxm_progress: testing, and between tests yielding
// the CPU, or sleeping nap when nap > 0) until a posted request completes,
// the doorbell rings or budget passes, and runs the handlers of those that
// completed; it returns how many did. With nothing posted it sleeps no
// more than budget on the wake channel.
func (w *world) progress(budget, nap time.Duration) int {
	if w.active == 0 {
		if w.idle == nil {
			w.idle = time.NewTimer(budget)
		} else {
			w.idle.Reset(budget)
		}
		select {
		case <-w.wake:
		case <-w.idle.C:
		}
		w.idle.Stop()
		return 0
	}
	var out C.int
	rc := C.kxm_progress(C.int(len(w.reqs)), &w.reqs[0], &out, &w.indices[0], &w.statuses[0], w.bell, C.longlong(budget), C.longlong(nap))
	return w.complete(rc, out, "MPI_Testsome")
}

// complete runs the handlers of the out requests that MPI reported done
// (indices and statuses), freeing their slots first.
func (w *world) complete(rc, out C.int, op string) int {
	if out == C.MPI_UNDEFINED || out <= 0 {
		if rc != 0 {
			w.log.Error("mpi: "+op+" failed", "err", mpiErr(op, rc))
		}
		return 0
	}
	n := int(out)
	done := w.done[:0]
	for k := range n {
		i := int(w.indices[k])
		var src, count, cancelled, errc C.int
		C.kxm_status(&w.statuses[k], &src, &count, &cancelled, &errc)
		c := completion{Source: int(src), Count: int(count), Cancelled: cancelled != 0}
		if rc != 0 && errc != 0 {
			c.Err = mpiErr("request", errc)
		}
		done = append(done, completed{w.handlers[i], c})
		w.handlers[i] = nil
		w.freeSlot = append(w.freeSlot, i)
		w.active--
	}
	// The handlers may post (and so test) again: they run from a copy
	// of nothing that testsome reuses.
	w.done = nil
	for k := range done {
		done[k].h(done[k].c)
		done[k] = completed{}
	}
	w.done = done[:0]
	return n
}

// postCtlRecv posts one standing control receive into buf (ctlLen bytes
// of C memory); its handler dispatches the message and posts it again.
func (w *world) postCtlRecv(buf unsafe.Pointer) error {
	i := w.slot(func(c completion) {
		if c.Cancelled {
			return
		}
		if c.Err == nil {
			m, err := parseCtl(unsafe.Slice((*byte)(buf), c.Count))
			if err != nil {
				w.log.Warn("mpi: dropped a control message", "from", c.Source, "err", err)
			} else {
				w.dispatch(c.Source, m)
			}
		} else {
			w.log.Warn("mpi: control receive failed", "err", c.Err)
		}
		select {
		case <-w.stop:
			return
		default:
		}
		if err := w.postCtlRecv(buf); err != nil {
			w.log.Error("mpi: cannot post a control receive", "err", err)
		}
	}, slotCtl)
	if rc := C.kxm_irecv(buf, ctlLen, C.kxm_any_source(), 0, w.ctl, &w.reqs[i]); rc != 0 {
		w.unslot(i, slotCtl)
		return mpiErr("MPI_Irecv", rc)
	}
	return nil
}

// sendCtl sends m to rank dest on the control communicator.
func (w *world) sendCtl(dest int, m ctlMsg) {
	buf := C.malloc(ctlLen)
	m.put(unsafe.Slice((*byte)(buf), ctlLen))
	i := w.slot(func(c completion) {
		C.free(buf)
		if c.Err != nil {
			w.log.Warn("mpi: control send failed", "to", dest, "kind", m.Kind, "err", c.Err)
		}
	}, slotCtl)
	if rc := C.kxm_isend(buf, ctlLen, C.int(dest), 0, w.ctl, &w.reqs[i]); rc != 0 {
		w.unslot(i, slotCtl)
		C.free(buf)
		w.log.Error("mpi: control send failed", "to", dest, "kind", m.Kind, "err", mpiErr("MPI_Isend", rc))
	}
}

// postData posts one frame: a send to (or, recv, a receive from) peer on
// the data communicator, of the blocks of pieces. It returns the slot.
func (w *world) postData(recv bool, peer, tag int, pieces [][]byte, blocks []block, h func(completion)) (int, error) {
	kind := slotSend
	if recv {
		kind = slotRecv
	}
	// The blocks as memory, end-to-end ones joined: most frames are one
	// contiguous message.
	spans := make([]span, len(blocks))
	for k, b := range blocks {
		spans[k] = span{Addr: uintptr(unsafe.Pointer(&pieces[b.Piece][b.Off])), Len: b.Len}
	}
	spans = mergeSpans(spans, math.MaxInt32)
	i := w.slot(h, kind)
	var rc C.int
	if len(spans) == 1 {
		// The first block's address, as a pointer: the run starts there.
		b := blocks[0]
		p := unsafe.Pointer(&pieces[b.Piece][b.Off])
		if recv {
			rc = C.kxm_irecv(p, C.int(spans[0].Len), C.int(peer), C.int(tag), w.data, &w.reqs[i])
		} else {
			rc = C.kxm_isend(p, C.int(spans[0].Len), C.int(peer), C.int(tag), w.data, &w.reqs[i])
		}
	} else {
		addrs := make([]C.MPI_Aint, len(spans))
		lens := make([]C.int, len(spans))
		for k, s := range spans {
			addrs[k] = C.MPI_Aint(s.Addr)
			lens[k] = C.int(s.Len)
		}
		if recv {
			rc = C.kxm_irecvv(&addrs[0], &lens[0], C.int(len(spans)), C.int(peer), C.int(tag), w.data, &w.reqs[i])
		} else {
			rc = C.kxm_isendv(&addrs[0], &lens[0], C.int(len(spans)), C.int(peer), C.int(tag), w.data, &w.reqs[i])
		}
	}
	if rc != 0 {
		w.unslot(i, kind)
		op := "MPI_Isend"
		if recv {
			op = "MPI_Irecv"
		}
		return 0, mpiErr(op, rc)
	}
	return i, nil
}

// postSink posts a receive of n bytes from peer at tag into scratch memory
// that is freed when it completes: a frame of a receipt that ended early.
func (w *world) postSink(peer, tag, n int) {
	buf := C.malloc(C.size_t(max(n, 1)))
	i := w.slot(func(completion) { C.free(buf) }, slotRecv)
	if rc := C.kxm_irecv(buf, C.int(n), C.int(peer), C.int(tag), w.data, &w.reqs[i]); rc != 0 {
		w.unslot(i, slotRecv)
		C.free(buf)
		w.log.Error("mpi: cannot drain a frame of an ended receipt", "from", peer, "tag", tag, "err", mpiErr("MPI_Irecv", rc))
	}
}

// cancelReq cancels the request in slot i (a receive); its handler runs
// when MPI completes it, cancelled or not.
func (w *world) cancelReq(i int) {
	if rc := C.kxm_cancel(&w.reqs[i]); rc != 0 {
		w.log.Warn("mpi: MPI_Cancel failed", "err", mpiErr("MPI_Cancel", rc))
	}
}

// tag returns a fresh data tag.
func (w *world) tag() int {
	w.nextTag++
	if w.nextTag > w.tagUB || w.nextTag <= 0 {
		w.nextTag = 1
	}
	return w.nextTag
}

// mpiErr turns an MPI error code into an *Error.
func mpiErr(op string, rc C.int) error {
	var buf [256]C.char
	C.kxm_errstr(rc, &buf[0], C.int(len(buf)))
	return &Error{Op: op, Code: int(rc), Msg: C.GoString(&buf[0])}
}
