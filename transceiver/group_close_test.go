package transceiver

import (
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
)

// TestGroupCloseEndsEveryRequest: Close on a process of a split instance
// ends every request of that process, however late its ranks' last
// reports come (here each is held 20 ms, as a descheduled goroutine would
// hold it): after Close the group applies nothing more, so what its log
// did not complete, Close does, with ErrClosed.
func TestGroupCloseEndsEveryRequest(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			in := newSplit(t, mode, state(2, 4, 16, 8, kvcache.FP16, 2, 1, false), testCfg(), 16)
			r := in.procs[0].t.ranks[0]
			report := r.done
			r.done = func(rank int, key instKey, err error, res rankResult) {
				time.Sleep(20 * time.Millisecond)
				report(rank, key, err, res)
			}
			creqs, _ := in.respond(t, 12, 16, 1)
			if err := in.procs[0].t.Close(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-creqs[0].done:
			case <-time.After(3 * time.Second):
				t.Fatalf("request 12 still %s 3s after Close", creqs[0].State())
			}
			if creqs[0].State() != DisaggTransError || !errors.Is(creqs[0].Err(), ErrClosed) && !errors.Is(creqs[0].Err(), ErrGroupLost) {
				t.Errorf("request 12 after Close: %s, %v; want DISAGG_TRANS_ERROR with ErrClosed or ErrGroupLost", creqs[0].State(), creqs[0].Err())
			}
		})
	}
}
