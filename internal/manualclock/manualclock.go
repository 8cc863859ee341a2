package manualclock

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

// Clock is a clock that only moves when Advance is called. It starts at the
// wall clock, so that what it dates (a signed opaque state, say) is valid
// for real peers too. Safe for concurrent use.
type Clock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*timer
	armed  chan struct{} // closed and replaced whenever a timer is armed
}

type timer struct {
	at   time.Time
	f    func()
	done bool // fired or stopped
}

// New returns a clock set to the wall clock's time.
func New() *Clock { return &Clock{now: time.Now(), armed: make(chan struct{})} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc arms a timer that calls f, in a goroutine of its own, once the
// clock has been advanced by d. stop disarms it and reports whether it did
// (false: f has run or is running, or stop was called before).
func (c *Clock) AfterFunc(d time.Duration, f func()) (stop func() bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &timer{at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	close(c.armed)
	c.armed = make(chan struct{})
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		stopped := !t.done
		t.done = true
		return stopped
	}
}

// Advance moves the clock d forward and runs the functions of the timers
// then due, each in its own goroutine as time.AfterFunc does; it returns
// once they have returned.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []func()
	live := c.timers[:0]
	for _, t := range c.timers {
		switch {
		case t.done:
		case !t.at.After(c.now):
			t.done = true
			due = append(due, t.f)
		default:
			live = append(live, t)
		}
	}
	c.timers = live
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, f := range due {
		wg.Go(f)
	}
	wg.Wait()
}

// WaitArmed waits until at least n timers are armed (neither fired nor
// stopped), and fails tb after 5 s: before a test advances the clock past
// a deadline, the goroutine that keeps it must have armed it.
func (c *Clock) WaitArmed(tb testing.TB, n int) {
	tb.Helper()
	c.waitFor(tb, fmt.Sprintf("%d timers armed", n), func(armed []time.Time) bool { return len(armed) >= n })
}

// WaitArmedAt waits until a timer is armed for the moment at, and fails tb
// after 5 s.
func (c *Clock) WaitArmedAt(tb testing.TB, at time.Time) {
	tb.Helper()
	c.waitFor(tb, fmt.Sprintf("a timer armed for %v", at), func(armed []time.Time) bool {
		return slices.ContainsFunc(armed, at.Equal)
	})
}

// waitFor waits until ok holds of the times of the armed timers, checking
// again whenever a timer is armed.
func (c *Clock) waitFor(tb testing.TB, what string, ok func(armed []time.Time) bool) {
	tb.Helper()
	limit := time.NewTimer(5 * time.Second)
	defer limit.Stop()
	for {
		c.mu.Lock()
		var armed []time.Time
		for _, t := range c.timers {
			if !t.done {
				armed = append(armed, t.at)
			}
		}
		next := c.armed
		c.mu.Unlock()
		if ok(armed) {
			return
		}
		select {
		case <-next:
		case <-limit.C:
			tb.Fatalf("manualclock: no %s after 5s (armed: %v)", what, armed)
		}
	}
}
