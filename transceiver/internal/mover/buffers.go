package mover

import (
	"context"
	"errors"
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
	slots     chan buffer // a zero entry is a buffer not yet allocated
	inUse     atomic.Int64
	allocated atomic.Int64
	limit     HoldLimit
	alloc     Alloc

	mu     sync.Mutex
	held   map[*Lease]struct{} // leases that may still be stopped
	closed bool                // Close was called: buffers put back are released
}

// buffer is a staging buffer and what releases it (nil: the collector).
type buffer struct {
	b    []byte
	free func() error
}

// Alloc allocates a staging buffer of size bytes, zeroed, and returns it
// with the function that releases it (called once, when the Buffers are
// closed and the buffer is back). nil is make([]byte, size), which the
// garbage collector releases.
type Alloc func(size int) (buf []byte, free func() error, err error)

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

// NewBuffers returns count buffers of size bytes, none allocated yet (alloc
// allocates them at their first use; nil: the Go heap), whose holders are
// stopped past limit while others wait.
func NewBuffers(count, size int, limit HoldLimit, alloc Alloc) *Buffers {
	p := &Buffers{size: size, slots: make(chan buffer, count), limit: limit, alloc: alloc, held: map[*Lease]struct{}{}}
	for range count {
		p.slots <- buffer{}
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
	buf   buffer // Buf and its release, as it goes back
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
	return p.lease(b, h)
}

// TryHold is Hold when a buffer is free now.
func (p *Buffers) TryHold(h Holder) (*Lease, bool) {
	select {
	case b := <-p.slots:
		l, err := p.lease(b, h)
		return l, err == nil
	default:
		return nil, false
	}
}

func (p *Buffers) lease(b buffer, h Holder) (*Lease, error) {
	b, err := p.take(b) // a first use allocates: not the holder's time
	if err != nil {
		return nil, err
	}
	now := time.Now()
	l := &Lease{Buf: b.b, buf: b, p: p, h: h, since: now, due: now.Add(p.limit.For(h.Bytes)), done: make(chan struct{})}
	if p.limit.Base > 0 && h.Stop != nil {
		p.mu.Lock()
		p.held[l] = struct{}{}
		p.mu.Unlock()
	}
	return l, nil
}

// Release puts the lease's buffer back. Once only.
func (l *Lease) Release() {
	l.p.mu.Lock()
	delete(l.p.held, l)
	l.p.mu.Unlock()
	l.p.put(l.buf)
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
func (p *Buffers) wait(ctx context.Context, owner any) (buffer, error) {
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
			return buffer{}, context.Cause(ctx)
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
			return buffer{}, context.Cause(ctx)
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

// take makes b, a buffer taken from the slots, ready for use: a zero one
// is allocated. On an error the slot goes back empty.
func (p *Buffers) take(b buffer) (buffer, error) {
	if b.b == nil {
		if p.alloc == nil {
			b.b = make([]byte, p.size)
		} else {
			buf, free, err := p.alloc(p.size)
			if err != nil {
				p.slots <- buffer{}
				return buffer{}, fmt.Errorf("mover: staging buffer of %d bytes: %w", p.size, err)
			}
			b = buffer{b: buf, free: free}
		}
		p.allocated.Add(1)
	}
	p.inUse.Add(1)
	return b, nil
}

// Close releases the buffers allocated with alloc: those that are back now,
// and each other one as it comes back. Call it once no transfer will take a
// buffer again (a Hold after Close allocates anew, and Close of the
// Buffers again is needed to release that one). Idempotent.
func (p *Buffers) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	var errs []error
	for range cap(p.slots) {
		select {
		case b := <-p.slots:
			errs = append(errs, p.release(b))
			p.slots <- buffer{}
		default:
		}
	}
	return errors.Join(errs...)
}

// release frees b if alloc allocated it.
func (p *Buffers) release(b buffer) error {
	if b.b == nil || b.free == nil {
		return nil
	}
	p.allocated.Add(-1)
	return b.free()
}

// put gives a buffer back, or releases it once the Buffers are closed.
// Putting back more buffers than were taken panics rather than block.
func (p *Buffers) put(b buffer) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		p.release(b)
		b = buffer{}
	}
	select {
	case p.slots <- b:
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
