package mover

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Buffers is a fixed number of staging buffers of one size, allocated on
// first use and reused: the memory a rank spends on staging is bounded by
// count × size whatever the size of the requests (a larger request is
// streamed through in chunks). Its methods may be called from any
// goroutine.
//
// The buffers are shared by every request of a rank, and a transfer holds
// one while its peer moves the chunk's bytes: a peer that stops reading
// (or sending) would keep it until its request's deadline, and a few such
// peers would hold up every other request's staged transfers. So a buffer
// taken with Hold carries a hold limit (HoldLimit): once a holder has kept
// its buffer past the limit while another caller waits for one, the
// holder's stop function is called with an error that wraps
// HoldLimit.Err, and the transfer ends, putting the buffer back. Nobody
// is stopped while no one waits: a slow transfer that takes nothing from
// anyone keeps its buffer until its own deadline.
type Buffers struct {
	size      int
	slots     chan []byte // a nil entry is a buffer not yet allocated
	inUse     atomic.Int64
	allocated atomic.Int64
	limit     HoldLimit

	mu   sync.Mutex
	held map[*Lease]struct{} // leases that may still be stopped
}

// HoldLimit is how long a holder may keep a buffer while others wait:
// Base, plus the time its bytes take at Rate bytes a second (0: Base
// alone). A zero Base stops nobody.
type HoldLimit struct {
	Base time.Duration
	Rate int64
	// Err is wrapped by the error a stopped holder is given.
	Err error
}

// of returns the limit for a holder of n bytes.
func (l HoldLimit) of(n int64) time.Duration {
	d := l.Base
	if l.Rate > 0 && n > 0 {
		d += time.Duration(float64(n) / float64(l.Rate) * float64(time.Second))
	}
	return d
}

// NewBuffers returns count buffers of size bytes, none allocated yet,
// whose holders are stopped past limit while others wait.
func NewBuffers(count, size int, limit HoldLimit) *Buffers {
	p := &Buffers{size: size, slots: make(chan []byte, count), limit: limit, held: map[*Lease]struct{}{}}
	for range count {
		p.slots <- nil
	}
	return p
}

// Lease is a buffer taken with Hold or TryHold, until Release.
type Lease struct {
	// Buf is the buffer, of the pool's size.
	Buf   []byte
	p     *Buffers
	since time.Time
	due   time.Time // since + the hold limit for its bytes
	n     int64
	stop  context.CancelCauseFunc

	err  error         // set under p.mu when the holder was stopped
	done chan struct{} // closed by Release
}

// Hold waits for a free buffer for a transfer that moves n bytes through
// it, or for ctx to end (its cause). stop ends the transfer: it is called
// at most once, with an error that wraps the limit's Err, when the lease
// has been held past the limit while another caller waits (see Buffers).
func (p *Buffers) Hold(ctx context.Context, n int64, stop context.CancelCauseFunc) (*Lease, error) {
	b, err := p.wait(ctx)
	if err != nil {
		return nil, err
	}
	return p.lease(b, n, stop), nil
}

// TryHold is Hold when a buffer is free now.
func (p *Buffers) TryHold(n int64, stop context.CancelCauseFunc) (*Lease, bool) {
	select {
	case b := <-p.slots:
		return p.lease(b, n, stop), true
	default:
		return nil, false
	}
}

func (p *Buffers) lease(b []byte, n int64, stop context.CancelCauseFunc) *Lease {
	now := time.Now()
	l := &Lease{Buf: p.take(b), p: p, since: now, due: now.Add(p.limit.of(n)), n: n, stop: stop, done: make(chan struct{})}
	if p.limit.Base > 0 && stop != nil {
		p.mu.Lock()
		p.held[l] = struct{}{}
		p.mu.Unlock()
	}
	return l
}

// Release puts the lease's buffer back. Once only.
func (l *Lease) Release() {
	l.p.mu.Lock()
	delete(l.p.held, l)
	l.p.mu.Unlock()
	l.p.Put(l.Buf)
	close(l.done) // after the Put: a waiter it wakes finds the buffer there
}

// Err is the error the holder was stopped with, or nil.
func (l *Lease) Err() error {
	l.p.mu.Lock()
	defer l.p.mu.Unlock()
	return l.err
}

// wait takes a free buffer, waiting for one, or for ctx to end; while it
// waits, it stops the holder due earliest once it is past its limit, and
// another only after that one has given its buffer back (to a waiter that
// took it first).
func (p *Buffers) wait(ctx context.Context) ([]byte, error) {
	select {
	case b := <-p.slots:
		return b, nil
	default:
	}
	if p.limit.Base <= 0 {
		select {
		case b := <-p.slots:
			return b, nil
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
	var stopped *Lease // the holder this caller stopped, until it lets go
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		select { // first, a buffer already free (the stopped holder's)
		case b := <-p.slots:
			return b, nil
		default:
		}
		var due <-chan time.Time
		var let <-chan struct{}
		if stopped != nil {
			let = stopped.done
		} else {
			t.Reset(p.untilDue())
			due = t.C
		}
		select {
		case b := <-p.slots:
			return b, nil
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-let:
			stopped = nil
		case <-due:
			stopped = p.stopOverdue()
		}
	}
}

// untilDue is the time until the earliest lease that may be stopped is
// due; with none, Base (a lease taken in the meantime is due no sooner).
func (p *Buffers) untilDue() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	d := p.limit.Base
	for l := range p.held {
		d = min(d, l.due.Sub(now))
	}
	return max(d, 0)
}

// stopOverdue stops the lease due earliest, if it is past due, and
// returns it.
func (p *Buffers) stopOverdue() *Lease {
	p.mu.Lock()
	now := time.Now()
	var first *Lease
	for l := range p.held {
		if !l.due.After(now) && (first == nil || l.due.Before(first.due)) {
			first = l
		}
	}
	if first == nil {
		p.mu.Unlock()
		return nil
	}
	delete(p.held, first)
	first.err = fmt.Errorf("%w: a transfer of %d bytes held a %d-byte staging buffer for %v (limit %v) while another transfer waited for one",
		p.limit.Err, first.n, p.size, now.Sub(first.since).Round(time.Millisecond), p.limit.of(first.n))
	err := first.err
	p.mu.Unlock()
	first.stop(err)
	return first
}

// Get waits for a free buffer, or for ctx to end (its cause). Its holder
// is never stopped (see Hold).
func (p *Buffers) Get(ctx context.Context) ([]byte, error) {
	b, err := p.wait(ctx)
	if err != nil {
		return nil, err
	}
	return p.take(b), nil
}

// TryGet returns a free buffer if there is one now.
func (p *Buffers) TryGet() ([]byte, bool) {
	select {
	case b := <-p.slots:
		return p.take(b), true
	default:
		return nil, false
	}
}

func (p *Buffers) take(b []byte) []byte {
	if b == nil {
		b = make([]byte, p.size)
		p.allocated.Add(1)
	}
	p.inUse.Add(1)
	return b
}

// Put returns a buffer taken with Get or TryGet (resliced to its full
// size: the caller may have cut it). Putting back more buffers than were
// taken panics rather than block.
func (p *Buffers) Put(b []byte) {
	select {
	case p.slots <- b[:p.size:p.size]:
		p.inUse.Add(-1)
	default:
		panic("mover: Buffers.Put of a buffer not taken")
	}
}

// Count is the number of buffers.
func (p *Buffers) Count() int { return cap(p.slots) }

// Size is the bytes of one buffer.
func (p *Buffers) Size() int { return p.size }

// InUse is the number of buffers taken and not yet put back.
func (p *Buffers) InUse() int64 { return p.inUse.Load() }

// Allocated is the number of buffers allocated so far (each once: a
// buffer never taken costs no memory).
func (p *Buffers) Allocated() int { return int(p.allocated.Load()) }
