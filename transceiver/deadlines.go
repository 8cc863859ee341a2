package transceiver

import (
	"container/heap"
	"time"
)

// deadlines are the deadline ticks a rank's cores asked for
// (effArmTimer): the requests' and the ask hold's, earliest first, behind
// one timer: arming a deadline costs a heap entry, not a timer of its own.
// The timer is armed for the earliest deadline, or earlier: a deadline
// given up (its request ended) leaves the timer as it is, and the tick
// finds nothing due and arms it for the next one; the timer is reset only
// for a deadline earlier than the one it is armed for (kv_transfer_timeout
// being the same for every request, a new one is rarely earlier) and
// stopped when no deadline is left. All of it is guarded by rank.mu; fire
// is called without it.
type deadlines struct {
	h     deadlineHeap
	timer *time.Timer // nil until first armed
	at    time.Time   // when the timer fires; zero: stopped
	fire  func()      // the timer's function
}

// tickEntry is the deadline tick of one core of a rank: a request's, or
// its ask hold's (q, among the rank's requests under sideHold).
type tickEntry struct {
	at  time.Time
	idx int // its place in the heap; -1: not armed
	q   *rankReq
}

func newTickEntry(q *rankReq) tickEntry { return tickEntry{idx: -1, q: q} }

// deadlineHeap orders deadlines by their time; each knows its place.
type deadlineHeap []*tickEntry

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h deadlineHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx, h[j].idx = i, j
}

func (h *deadlineHeap) Push(x any) {
	e := x.(*tickEntry)
	e.idx = len(*h)
	*h = append(*h, e)
}

func (h *deadlineHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	e.idx = -1
	return e
}

// arm sets e to at, replacing the time it had.
func (d *deadlines) arm(e *tickEntry, at time.Time) {
	e.at = at
	if e.idx >= 0 {
		heap.Fix(&d.h, e.idx)
	} else {
		heap.Push(&d.h, e)
	}
	if d.at.IsZero() || at.Before(d.at) {
		d.reset(at)
	}
}

// remove gives e up, if it is armed.
func (d *deadlines) remove(e *tickEntry) {
	if e.idx < 0 {
		return
	}
	heap.Remove(&d.h, e.idx)
	if len(d.h) == 0 {
		d.stop()
	}
}

// due takes out the deadlines not after now, and arms the timer for the
// next one.
func (d *deadlines) due(now time.Time) []*tickEntry {
	var out []*tickEntry
	for len(d.h) > 0 && !d.h[0].at.After(now) {
		out = append(out, heap.Pop(&d.h).(*tickEntry))
	}
	d.at = time.Time{}
	if len(d.h) > 0 {
		d.reset(d.h[0].at)
	}
	return out
}

func (d *deadlines) reset(at time.Time) {
	d.at = at
	if d.timer == nil {
		d.timer = time.AfterFunc(time.Until(at), d.fire)
		return
	}
	d.timer.Reset(time.Until(at))
}

func (d *deadlines) stop() {
	if d.timer != nil && !d.at.IsZero() {
		d.timer.Stop()
	}
	d.at = time.Time{}
}
