package transceiver

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"go.uber.org/goleak"
)

// TestSpawnWorkers: jobs run on worker goroutines; once they are done at
// most maxIdleWorkers stay, the next jobs reuse them (no goroutine
// started), and Close ends them all.
func TestSpawnWorkers(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	in := newInst(t, state(2, 2, 16, 4, kvcache.BF16, 1, 1, false), testCfg(), 4)
	r := in.t.ranks[0]
	run := func(n int) {
		var release, started sync.WaitGroup
		var ran atomic.Int32
		release.Add(1)
		started.Add(n)
		for range n {
			r.spawn(func() {
				started.Done()
				release.Wait() // all n at once: n workers
				ran.Add(1)
			})
		}
		started.Wait()
		release.Done()
		waitFor(t, 5*time.Second, "every job ran and its worker went idle or ended", func() bool {
			return ran.Load() == int32(n) && int(r.idle.Load()) == min(n, maxIdleWorkers)
		})
	}
	run(3 * maxIdleWorkers)
	before := runtime.NumGoroutine()
	for range 10 {
		done := make(chan struct{})
		r.spawn(func() { close(done) })
		<-done
	}
	waitFor(t, 5*time.Second, "the worker back to idle", func() bool { return int(r.idle.Load()) == maxIdleWorkers })
	if got := runtime.NumGoroutine(); got > before {
		t.Errorf("%d goroutines after 10 jobs on idle workers, %d before", got, before)
	}
	if err := in.t.Close(); err != nil {
		t.Fatal(err)
	}
	if n := r.idle.Load(); n != 0 {
		t.Errorf("%d workers idle after Close", n)
	}
}
