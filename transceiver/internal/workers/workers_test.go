package workers

import (
	"math/rand/v2"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); !ok(); {
		if time.Now().After(end) {
			t.Fatalf("after 5s: not %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestPool: jobs run on worker goroutines; once they are done at most
// maxIdle stay, the next jobs reuse them (no goroutine started), and
// Close ends them all.
func TestPool(t *testing.T) {
	const maxIdle = 4
	p := NewPool(maxIdle)
	run := func(n int) {
		var release, started sync.WaitGroup
		var ran atomic.Int32
		release.Add(1)
		started.Add(n)
		for range n {
			p.Go(func() {
				started.Done()
				release.Wait() // all n at once: n workers
				ran.Add(1)
			})
		}
		started.Wait()
		release.Done()
		waitFor(t, "every job ran and its worker went idle or ended", func() bool {
			return ran.Load() == int32(n) && p.Idle() == min(n, maxIdle)
		})
	}
	run(3 * maxIdle)
	before := runtime.NumGoroutine()
	for range 10 {
		done := make(chan struct{})
		p.Go(func() { close(done) })
		<-done
	}
	waitFor(t, "the worker back to idle", func() bool { return p.Idle() == maxIdle })
	if got := runtime.NumGoroutine(); got > before {
		t.Errorf("%d goroutines after 10 jobs on idle workers, %d before", got, before)
	}
	p.Close()
	p.Close() // idempotent
	if n := p.Idle(); n != 0 {
		t.Errorf("%d workers idle after Close", n)
	}
}

// TestPoolCloseWaits: Close waits for the jobs that run, those a job
// hands on included, and a job handed after Close still runs.
func TestPoolCloseWaits(t *testing.T) {
	p := NewPool(2)
	var ran atomic.Int32
	release := make(chan struct{})
	p.Go(func() {
		<-release
		p.Go(func() { ran.Add(1) }) // from inside a job
		ran.Add(1)
	})
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a job ran")
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	<-closed
	if got := ran.Load(); got != 2 {
		t.Fatalf("%d jobs ran by Close, want 2", got)
	}
	done := make(chan struct{})
	p.Go(func() { close(done) })
	<-done
	p.Close()
}

// TestPoolNoIdle: with maxIdle 0 every job has a goroutine of its own,
// which ends with it.
func TestPoolNoIdle(t *testing.T) {
	p := NewPool(0)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		p.Go(wg.Done)
	}
	wg.Wait()
	waitFor(t, "no idle worker", func() bool { return p.Idle() == 0 })
	p.Close()
}

// TestGroupAgainstNaive: random interleavings of Add, Done and Then; the
// function left runs exactly once, on the Done that brings the count to
// zero, as a plain counter says it must.
func TestGroupAgainstNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 2000 {
		var g Group
		n := 0 // the naive count
		ran := 0
		armed := false
		for step := 0; step < 40; step++ {
			switch op := rng.IntN(3); {
			case op == 0 || n == 0:
				k := 1 + rng.IntN(3)
				g.Add(k)
				n += k
			case op == 1:
				g.Done()
				n--
				if n == 0 && armed {
					armed = false
					if ran != 1 {
						t.Fatalf("trial %d step %d: Then's function ran %d times at zero, want 1", trial, step, ran)
					}
					ran = 0
				} else if ran != 0 {
					t.Fatalf("trial %d step %d: Then's function ran with %d members left", trial, step, n)
				}
			default:
				g.Then(func() { ran++ })
				armed = true
			}
		}
		for n > 0 {
			g.Done()
			n--
		}
		if armed && ran != 1 {
			t.Fatalf("trial %d: Then's function ran %d times at the end, want 1", trial, ran)
		}
	}
}

func TestGroupMisuse(t *testing.T) {
	for _, tc := range []struct {
		name string
		f    func(*Group)
	}{
		{"Done without Add", func(g *Group) { g.Done() }},
		{"Then outside a member", func(g *Group) { g.Then(func() {}) }},
		{"Then after the last Done", func(g *Group) { g.Add(1); g.Done(); g.Then(func() {}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Fatal("no panic")
				}
			}()
			tc.f(&Group{})
		})
	}
}

// TestIdleWorkerStack: an idle worker waits with Pool.work as the first
// frame of its stack outside the runtime, under this name. The chaos
// suite's leak check (tests/chaos, usage.add) knows idle workers by it and
// leaves them out; should the name or the wait move, this fails here
// rather than as false leaks there.
func TestIdleWorkerStack(t *testing.T) {
	const frame = "github.com/kvxfer/kvxfer/transceiver/internal/workers.(*Pool).work"
	p := NewPool(1)
	defer p.Close()
	p.Go(func() {})
	waitFor(t, "one idle worker", func() bool { return p.Idle() == 1 })
	var b strings.Builder
	if err := pprof.Lookup("goroutine").WriteTo(&b, 1); err != nil {
		t.Fatal(err)
	}
	found := false
	for group := range strings.SplitSeq(b.String(), "\n\n") {
		for line := range strings.SplitSeq(group, "\n") {
			parts := strings.Split(line, "\t")
			if len(parts) < 3 || parts[0] != "#" {
				continue
			}
			fn, _, _ := strings.Cut(parts[2], "+")
			if strings.HasPrefix(fn, "runtime.") {
				continue
			}
			found = found || fn == frame
			break // the first frame outside the runtime only
		}
	}
	if !found {
		t.Errorf("no goroutine whose first frame outside the runtime is %s:\n%s", frame, b.String())
	}
}
