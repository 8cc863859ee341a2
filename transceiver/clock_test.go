package transceiver

import (
	"github.com/kvxfer/kvxfer/internal/manualclock"
)

// manualClock is the clock tests advance by hand (internal/manualclock).
type manualClock = manualclock.Clock

func newManualClock() *manualClock { return manualclock.New() }

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
