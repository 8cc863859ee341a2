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
// its buffer past the limit while a caller for another owner (another
// request) waits for one, the holder's stop function is called with an
// error that wraps HoldLimit.Err, and the transfer ends, putting the
// buffer back. Nobody is stopped while no one waits, nor for a caller of
// the same owner (stopping one part of a request for another part of it
// fails the request all the same): a slow transfer that takes nothing
// from anyone keeps its buffer until its own deadline.
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

// For returns the limit for a holder of n bytes.
func (l HoldLimit) For(n int64) time.Duration {
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

// Holder is who takes a buffer with Hold or TryHold.
type Holder struct {
	// Owner is the request the transfer is part of (any comparable
	// value; nil: none): a caller never stops a holder of its own owner.
	Owner any
	// Bytes is what the transfer moves through the buffer (the hold
	// limit grows with it).
	Bytes int64
	// Stop ends the transfer: it is called at most once, with an error
	// that wraps the limit's Err, when the lease has been held past the
	// limit while a caller for another owner waits. nil: never stopped.
	Stop context.CancelCauseFunc
}

// Lease is a buffer taken with Hold or TryHold, until Release.
type Lease struct {
	// Buf is the buffer, of the pool's size.
	Buf   []byte
	p     *Buffers
	h     Holder
	since time.Time
	due   time.Time // since + the hold limit for its bytes

	err  error         // set under p.mu when the holder was stopped
	done chan struct{} // closed by Release
}

// Hold waits for a free buffer for h, or for ctx to end (its cause);
// while it waits, it stops holders of other owners that are past their
// limit (see Buffers).
func (p *Buffers) Hold(ctx context.Context, h Holder) (*Lease, error) {
	b, err := p.wait(ctx, h.Owner)
	if err != nil {
		return nil, err
	}
	return p.lease(b, h), nil
}

// TryHold is Hold when a buffer is free now.
func (p *Buffers) TryHold(h Holder) (*Lease, bool) {
	select {
	case b := <-p.slots:
		return p.lease(b, h), true
	default:
		return nil, false
	}
}

func (p *Buffers) lease(b []byte, h Holder) *Lease {
	b = p.take(b) // a first use allocates: not the holder's time
	now := time.Now()
	l := &Lease{Buf: b, p: p, h: h, since: now, due: now.Add(p.limit.For(h.Bytes)), done: make(chan struct{})}
	if p.limit.Base > 0 && h.Stop != nil {
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
	l.p.put(l.Buf)
	close(l.done) // after the Put: a waiter it wakes finds the buffer there
}

// Err is the error the holder was stopped with, or nil.
func (l *Lease) Err() error {
	l.p.mu.Lock()
	defer l.p.mu.Unlock()
	return l.err
}

// wait takes a free buffer for owner, waiting for one, or for ctx to end;
// while it waits, it stops the holder of another owner due earliest once
// it is past its limit, and another only after that one has given its
// buffer back (to a waiter that took it first).
func (p *Buffers) wait(ctx context.Context, owner any) ([]byte, error) {
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
			t.Reset(p.untilDue(owner))
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
			stopped = p.stopOverdue(owner)
		}
	}
}

// untilDue is the time until the earliest lease that owner's caller may
// stop is due; with none, Base (a lease taken in the meantime is due no
// sooner).
func (p *Buffers) untilDue(owner any) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	d := p.limit.Base
	for l := range p.held {
		if !l.sameOwner(owner) {
			d = min(d, l.due.Sub(now))
		}
	}
	return max(d, 0)
}

// sameOwner reports whether l's holder has owner (nil is nobody's).
func (l *Lease) sameOwner(owner any) bool { return owner != nil && l.h.Owner == owner }

// stopOverdue stops the lease of another owner than owner due earliest,
// if it is past due, and returns it.
func (p *Buffers) stopOverdue(owner any) *Lease {
	p.mu.Lock()
	now := time.Now()
	var first *Lease
	for l := range p.held {
		if !l.sameOwner(owner) && !l.due.After(now) && (first == nil || l.due.Before(first.due)) {
			first = l
		}
	}
	if first == nil {
		p.mu.Unlock()
		return nil
	}
	delete(p.held, first)
	first.err = fmt.Errorf("%w: a transfer of %d bytes held a %d-byte staging buffer for %v (limit %v) while another transfer waited for one",
		p.limit.Err, first.h.Bytes, p.size, now.Sub(first.since).Round(time.Millisecond), p.limit.For(first.h.Bytes))
	err := first.err
	p.mu.Unlock()
	first.h.Stop(err)
	return first
}

func (p *Buffers) take(b []byte) []byte {
	if b == nil {
		b = make([]byte, p.size)
		p.allocated.Add(1)
	}
	p.inUse.Add(1)
	return b
}

// put gives a buffer back (resliced to its full size). Putting back more
// buffers than were taken panics rather than block.
func (p *Buffers) put(b []byte) {
	select {
	case p.slots <- b[:p.size:p.size]:
		p.inUse.Add(-1)
	default:
		panic("mover: Buffers.put of a buffer not taken")
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
