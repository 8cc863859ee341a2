package transceiver

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"go.uber.org/goleak"
)

// TestRankWorkers: a rank's sends and receives run on its worker pool
// (workers.Pool, whose own tests cover reuse and the idle bound): after
// transfers the ranks keep idle workers, at most maxIdleWorkers each, and
// Close ends them all. (The pool's reuse test moved to
// internal/workers's TestPool.)
func TestRankWorkers(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 16)
	gen := newInst(t, s, testCfg(), 16)
	for i := range 4 {
		transfer(t, sender, gen, uint64(i+1), 16, uint64(i), 0, 0)
	}
	for _, in := range []*inst{sender, gen} {
		// The worker whose job ended a request goes idle just after it
		// reported the end (the report is part of its job): wait for
		// that, bounded, rather than catch it in between.
		waitFor(t, 5*time.Second, "an idle worker after 4 transfers", func() bool { return in.idleWorkers() > 0 })
		n := in.idleWorkers()
		if n == 0 || n > maxIdleWorkers*len(in.t.ranks) {
			t.Errorf("%d idle workers after 4 transfers, want 1..%d", n, maxIdleWorkers*len(in.t.ranks))
		}
		if err := in.t.Close(); err != nil {
			t.Fatal(err)
		}
		if n := in.idleWorkers(); n != 0 {
			t.Errorf("%d workers idle after Close", n)
		}
	}
}
