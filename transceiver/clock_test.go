package transceiver

import (
	"sync"
	"testing"
	"time"
)

// manualClock is a clock that tests advance by hand: deadlines pass when
// the test says so, not after a real sleep. It starts at the wall clock, so
// that signed opaque states it dates are valid for real peers too.
type manualClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*manualTimer
	armed  chan struct{} // closed and replaced whenever a timer is armed
}

type manualTimer struct {
	at   time.Time
	f    func()
	done bool // fired or stopped
}

func newManualClock() *manualClock { return &manualClock{now: time.Now(), armed: make(chan struct{})} }

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *manualClock) AfterFunc(d time.Duration, f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &manualTimer{at: c.now.Add(d), f: f}
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
// that are then due, each in its own goroutine as time.AfterFunc does; it
// returns once they have returned.
func (c *manualClock) Advance(d time.Duration) {
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

// waitArmed waits until at least n timers are armed (neither fired nor
// stopped): before a test advances the clock past a deadline, the
// goroutine that keeps it must have armed it.
func (c *manualClock) waitArmed(t *testing.T, n int) {
	t.Helper()
	limit := time.NewTimer(5 * time.Second)
	defer limit.Stop()
	for {
		c.mu.Lock()
		armed := 0
		for _, tm := range c.timers {
			if !tm.done {
				armed++
			}
		}
		next := c.armed
		c.mu.Unlock()
		if armed >= n {
			return
		}
		select {
		case <-next:
		case <-limit.C:
			t.Fatalf("%d timers armed after 5s, want %d", armed, n)
		}
	}
}

// withClock makes an instance take its deadlines from clk.
func withClock(clk *manualClock) func(*Options) {
	return func(o *Options) { o.clock = clk }
}

// heldBy counts the ranks of in that still hold the request of side with
// instance id reqID.
func heldBy(in *inst, s side, reqID uint64) int {
	n := 0
	for _, r := range in.t.ranks {
		r.mu.Lock()
		for k, q := range r.reqs {
			if k.side == s && q.reqID == reqID {
				n++
			}
		}
		r.mu.Unlock()
	}
	return n
}
