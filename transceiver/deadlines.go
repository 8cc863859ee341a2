package transceiver

import (
	"container/heap"
	"time"
)

// deadlines are the deadline ticks the requests of a rank asked for
// (effArmTimer), earliest first, behind one timer: arming a request's
// deadline costs a heap entry, not a timer of its own. The timer is armed
// for the earliest deadline, or earlier: a deadline given up (its request
// ended) leaves the timer as it is, and the tick finds nothing due and
// arms it for the next one; the timer is reset only for a deadline earlier
// than the one it is armed for (kv_transfer_timeout being the same for
// every request, a new one is never earlier) and stopped when no deadline
// is left. All of it is guarded by rank.mu; fire is called without it.
type deadlines struct {
	h     deadlineHeap
	timer *time.Timer // nil until first armed
	at    time.Time   // when the timer fires; zero: stopped
	fire  func()      // the timer's function
}

// deadlineHeap orders requests by their deadline (rankReq.due); each
// knows its place (rankReq.dueAt, -1 when not in the heap).
type deadlineHeap []*rankReq

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h deadlineHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].dueAt, h[j].dueAt = i, j
}

func (h *deadlineHeap) Push(x any) {
	q := x.(*rankReq)
	q.dueAt = len(*h)
	*h = append(*h, q)
}

func (h *deadlineHeap) Pop() any {
	old := *h
	q := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	q.dueAt = -1
	return q
}

// arm sets q's deadline to at, replacing the one it had.
func (d *deadlines) arm(q *rankReq, at time.Time) {
	q.due = at
	if q.dueAt >= 0 {
		heap.Fix(&d.h, q.dueAt)
	} else {
		heap.Push(&d.h, q)
	}
	if d.at.IsZero() || at.Before(d.at) {
		d.reset(at)
	}
}

// remove gives q's deadline up, if it has one.
func (d *deadlines) remove(q *rankReq) {
	if q.dueAt < 0 {
		return
	}
	heap.Remove(&d.h, q.dueAt)
	if len(d.h) == 0 {
		d.stop()
	}
}

// due takes out the requests whose deadline is not after now, and arms the
// timer for the next one.
func (d *deadlines) due(now time.Time) []*rankReq {
	var out []*rankReq
	for len(d.h) > 0 && !d.h[0].due.After(now) {
		out = append(out, heap.Pop(&d.h).(*rankReq))
	}
	d.at = time.Time{}
	if len(d.h) > 0 {
		d.reset(d.h[0].due)
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
