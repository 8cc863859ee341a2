package transceiver

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// The consensus scripts (testdata/consensus) run again, unchanged, with the
// consensus core replicated over the processes of a group, in each mode:
// every event is published by one process (the one hosting its rank),
// travels through the group's log (encoded, as between processes), and
// every process's copy of the core must give exactly the effects the
// script expects. A begin is, as in a split Transceiver, a join-begin
// after the process's own check for a request already in flight.

// coreMember is a process of the conformance test: a replicated core.
type coreMember struct {
	mu   sync.Mutex
	c    *consensus
	outs []string // the effects of each event applied, in log order
}

func (m *coreMember) joined([]groupJoin) error { return nil }
func (m *coreMember) lost(err error) instEvent { return ranksLostEvent{err: err} }
func (m *coreMember) apply(evs []instEvent) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ev := range evs {
		m.outs = append(m.outs, effectLines(m.c.step(ev)))
	}
}

// groupedConsensusInterp runs a consensus script through a group.
type groupedConsensusInterp struct {
	groups  []Group
	members []*coreMember
	applied int
}

func newGroupedConsensus(t *testing.T, mode groupMode, n int) *groupedConsensusInterp {
	groups, drive, _ := mode.make(t, n)
	drive()
	in := &groupedConsensusInterp{groups: groups}
	var wg sync.WaitGroup
	for p := range n {
		m := &coreMember{c: newConsensus()}
		in.members = append(in.members, m)
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := groups[p].start(ctx, m, groupJoin{ranks: []int{p}, endpoints: []string{fmt.Sprint("e", p)}}); err != nil {
				t.Errorf("start %d: %v", p, err)
			}
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, g := range groups {
			g.close()
		}
	})
	return in
}

func (in *groupedConsensusInterp) run(t *testing.T, c *scriptCmd) string {
	key := scriptKey(t, c)
	m0 := in.members[0]
	var ev instEvent
	from := 0
	switch c.name {
	case "begin":
		ranks, at := c.ints(t, "ranks"), scriptAt(t, c)
		m0.mu.Lock()
		_, dup := m0.c.reqs[key]
		m0.mu.Unlock()
		if dup {
			return fmt.Sprintf("error: transceiver: request %d is already in flight", key.id)
		}
		ev = joinBeginEvent{key: key, ranks: ranks, now: at}
	case "in-flight":
		m0.mu.Lock()
		defer m0.mu.Unlock()
		all, reported := m0.c.inFlight(key.side)
		return fmt.Sprintf("in flight: %d, reported by Check: %d", all, reported)
	case "begun-elsewhere":
		// Every process's copy of the log gives the same answer.
		rank := c.int(t, "rank", 0)
		var out string
		for p, m := range in.members {
			m.mu.Lock()
			got := begunLine(m.c, key, rank)
			m.mu.Unlock()
			if p == 0 {
				out = got
			} else if got != out {
				t.Fatalf("%s: process %d says %q, process 0 %q", c.pos, p, got, out)
			}
		}
		return out
	default:
		ev = consensusEvent(t, c, key)
		if c.has("rank") {
			from = c.int(t, "rank", 0) % len(in.members)
		}
	}
	in.groups[from].publish(ev)
	in.applied++
	deadline := time.Now().Add(10 * time.Second)
	var out string
	for p, m := range in.members {
		for {
			m.mu.Lock()
			n := len(m.outs)
			if n >= in.applied {
				if p == 0 {
					out = m.outs[in.applied-1]
				} else if got := m.outs[in.applied-1]; got != out {
					m.mu.Unlock()
					t.Fatalf("%s: process %d's core gave\n%s\nprocess 0's\n%s", c.pos, p, got, out)
				}
			}
			m.mu.Unlock()
			if n >= in.applied {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: process %d applied %d events of %d within 10s", c.pos, p, n, in.applied)
			}
			time.Sleep(100 * time.Microsecond)
		}
	}
	return out
}

// TestConsensusScriptsOverGroups: the consensus scripts, through three
// processes of each group mode.
func TestConsensusScriptsOverGroups(t *testing.T) {
	if *update {
		t.Skip("the scripts are rewritten by TestConsensusScripts")
	}
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			runScripts(t, "testdata/consensus/*.script", func() func(*testing.T, *scriptCmd) string {
				return newGroupedConsensus(t, mode, 3).run
			})
		})
	}
}
