package transceiver

import (
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestDeadlines: random arms, re-arms, removals and ticks against a naive
// reference (a map of deadlines): a tick takes out exactly the deadlines
// that have come, and the timer is armed no later than the
// earliest deadline left (stopped when none is).
func TestDeadlines(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		var d deadlines
		d.fire = func() {}
		defer d.stop()
		base := time.Now().Add(time.Hour) // the timer never fires within the test
		qs := make([]*tickEntry, 16)
		for i := range qs {
			e := newTickEntry(&rankReq{reqID: uint64(i)})
			if i == 0 {
				e = newTickEntry(nil) // the ask hold's
			}
			qs[i] = &e
		}
		want := map[*tickEntry]time.Time{}
		now := base
		for step := range 400 {
			q := qs[rng.IntN(len(qs))]
			switch op := rng.IntN(4); op {
			case 0, 1: // arm or re-arm
				at := now.Add(time.Duration(rng.IntN(100)) * time.Millisecond)
				d.arm(q, at)
				want[q] = at
			case 2:
				d.remove(q)
				delete(want, q)
			case 3:
				now = now.Add(time.Duration(rng.IntN(50)) * time.Millisecond)
				got := d.due(now)
				var exp []*tickEntry
				for w, at := range want {
					if !at.After(now) {
						exp = append(exp, w)
						delete(want, w)
					}
				}
				byID := func(a, b *tickEntry) int { return int(id(a)) - int(id(b)) }
				slices.SortFunc(got, byID)
				slices.SortFunc(exp, byID)
				if !slices.Equal(got, exp) {
					t.Fatalf("seed %d step %d: due %v, want %v", seed, step, ids(got), ids(exp))
				}
			}
			if len(d.h) != len(want) {
				t.Fatalf("seed %d step %d: %d deadlines kept, want %d", seed, step, len(d.h), len(want))
			}
			if len(want) == 0 {
				if !d.at.IsZero() {
					t.Fatalf("seed %d step %d: timer armed at %v with no deadline", seed, step, d.at)
				}
				continue
			}
			first := slices.MinFunc(slices.Collect(maps.Values(want)), func(a, b time.Time) int { return a.Compare(b) })
			if d.at.IsZero() || d.at.After(first) {
				t.Fatalf("seed %d step %d: timer at %v, earliest deadline %v", seed, step, d.at, first)
			}
			for i, q := range d.h {
				if q.idx != i || !q.at.Equal(want[q]) {
					t.Fatalf("seed %d step %d: entry %d: place %d, due %v, want %v", seed, step, i, q.idx, q.at, want[q])
				}
			}
		}
	}
}

// id names an entry in the test: its request's id, 0 for the hold's.
func id(e *tickEntry) uint64 {
	if e.q == nil {
		return 0
	}
	return e.q.reqID
}

func ids(es []*tickEntry) []uint64 {
	out := make([]uint64, len(es))
	for i, e := range es {
		out[i] = id(e)
	}
	return out
}
