package manualclock

import (
	"sync/atomic"
	"testing"
	"time"
)

func TestAdvanceRunsDueTimersOnly(t *testing.T) {
	c := New()
	start := c.Now()
	var early, late, stopped atomic.Int32
	c.AfterFunc(time.Second, func() { early.Add(1) })
	c.AfterFunc(3*time.Second, func() { late.Add(1) })
	stop := c.AfterFunc(time.Second, func() { stopped.Add(1) })
	c.WaitArmed(t, 3)
	if !stop() || stop() {
		t.Fatal("stop: want true once, then false")
	}
	c.Advance(999 * time.Millisecond)
	if early.Load() != 0 {
		t.Fatal("a timer fired before its time")
	}
	c.Advance(time.Millisecond)
	if early.Load() != 1 || late.Load() != 0 || stopped.Load() != 0 {
		t.Fatalf("after 1s: early %d late %d stopped %d, want 1 0 0", early.Load(), late.Load(), stopped.Load())
	}
	c.Advance(2 * time.Second)
	if late.Load() != 1 || early.Load() != 1 {
		t.Fatalf("after 3s: early %d late %d, want 1 1", early.Load(), late.Load())
	}
	if got := c.Now().Sub(start); got != 3*time.Second {
		t.Fatalf("Now moved %v, want 3s", got)
	}
}

func TestWaitArmedWakesOnArm(t *testing.T) {
	c := New()
	go func() {
		time.Sleep(time.Millisecond)
		c.AfterFunc(time.Hour, func() {})
	}()
	c.WaitArmed(t, 1)
}
