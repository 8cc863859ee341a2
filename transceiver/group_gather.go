package transceiver

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// GatherGroup is a Group driven by the caller's own collective: each round,
// the caller takes this process's contribution (Outbox), runs an all-gather
// of it over the instance's processes (an MPI or torch communicator, as
// TensorRT-LLM has), and hands every process's contribution back, in
// process order (Deliver). Nothing calls the caller back: it polls, so
// that a C or Python engine can drive it from its own loop.
//
// The first round is the join: every process contributes its ranks and
// endpoints; until a round in which every process has joined is delivered,
// the Transceiver refuses requests (ErrNotJoined). Later rounds carry the
// ranks' reports; a process with nothing to report contributes an empty
// batch, and every process must take part in every round. The latency of
// the instance's consensus is that of the rounds: a request completes at
// the round after its last rank's report.
//
// When a round fails (a process died, the communicator broke), call Fail on
// every process that survives: its requests in flight fail at once with
// ErrGroupLost, and the Transceiver refuses new ones. Outbox, Deliver and
// Fail are safe for concurrent use; rounds must not overlap.
type GatherGroup struct {
	process, processes int

	mu      sync.Mutex
	m       groupMember
	self    []byte      // this process's join message
	joined  bool        // a round with every join has been delivered
	pending []instEvent // published, not yet in an outbox
	sent    []instEvent // in the last outbox, not yet delivered
	failed  error
	closed  bool
	echo    localEcho
	apply   sync.Mutex // serialises Deliver's application of a round
}

// NewGatherGroup returns the group of process (0-based, the index of this
// process in the caller's all-gather) of processes processes. It starts
// nothing.
func NewGatherGroup(process, processes int) *GatherGroup {
	return &GatherGroup{process: process, processes: processes}
}

func (g *GatherGroup) start(_ context.Context, m groupMember, self groupJoin) error {
	if g.processes < 1 || g.processes > maxGroupProcs || g.process < 0 || g.process >= g.processes {
		return fmt.Errorf("%w: gather group: process %d of %d", ErrBadGroup, g.process, g.processes)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.m != nil {
		return fmt.Errorf("%w: gather group already serves a transceiver", ErrBadGroup)
	}
	g.m, g.self = m, encodeJoin(self)
	return nil
}

// Outbox returns what this process contributes to the next round: its join
// until the group has joined, then the events its ranks reported since the
// last Outbox (possibly none). Call it once per round, then Deliver.
func (g *GatherGroup) Outbox() []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.joined {
		if g.self == nil {
			// Not started yet: take part in the round with nothing.
			b, _ := encodeBatch(g.process, nil)
			return b
		}
		return g.self
	}
	evs := g.pending
	if len(evs) > maxGroupEvents {
		evs = evs[:maxGroupEvents]
	}
	b, err := encodeBatch(g.process, evs)
	if err != nil {
		// Too many bytes: half as many events this round.
		evs = evs[:len(evs)/2]
		b, _ = encodeBatch(g.process, evs)
	}
	g.sent = append(g.sent, evs...)
	g.pending = g.pending[len(evs):]
	return b
}

// Deliver applies a round: all holds every process's contribution, in
// process order. Every process must deliver the same round. An error
// says that the round is not one (wrong count, a contribution that does not
// decode, a join that does not make the instance); the group is then
// broken on this process (as after Fail).
func (g *GatherGroup) Deliver(all [][]byte) error {
	g.apply.Lock()
	defer g.apply.Unlock()
	g.mu.Lock()
	m, joined, failed := g.m, g.joined, g.failed
	g.mu.Unlock()
	if failed != nil {
		return fmt.Errorf("transceiver: gather group: deliver: %w", failed)
	}
	if m == nil {
		// Not started: this process contributed an empty batch, so the
		// round cannot be the join; nothing else is ours to apply.
		return nil
	}
	if len(all) != g.processes {
		err := fmt.Errorf("%w: gather group: a round of %d contributions, the group has %d processes", ErrBadGroup, len(all), g.processes)
		g.Fail(err)
		return err
	}
	msgs := make([]*groupMsg, len(all))
	for p, b := range all {
		msg, err := decodeGroupMsg(b)
		if err != nil {
			err = fmt.Errorf("transceiver: gather group: contribution of process %d: %w", p, err)
			g.Fail(err)
			return err
		}
		msgs[p] = msg
	}
	if !joined {
		joins := make([]groupJoin, 0, len(msgs))
		for _, msg := range msgs {
			if msg.typ != groupMsgJoin {
				return nil // someone has not started yet: join at a later round
			}
			joins = append(joins, msg.join)
		}
		if err := m.joined(joins); err != nil {
			g.Fail(err)
			return err
		}
		g.mu.Lock()
		g.joined = true
		g.mu.Unlock()
		return nil
	}
	for p, msg := range msgs {
		switch msg.typ {
		case groupMsgBatch:
			if len(msg.events) > 0 {
				m.apply(msg.events)
			}
		case groupMsgJoin:
			// A late copy of a join: nothing to do.
		default:
			err := fmt.Errorf("%w: gather group: process %d contributed a message of type %d", ErrBadGroupMessage, p, msg.typ)
			g.Fail(err)
			return err
		}
	}
	g.mu.Lock()
	g.sent = nil
	g.mu.Unlock()
	return nil
}

// Fail breaks the group on this process, for err (the round that failed):
// every request in flight fails with ErrGroupLost, and new ones are
// refused. Idempotent.
func (g *GatherGroup) Fail(err error) {
	g.leave(err)
}

func (g *GatherGroup) leave(err error) {
	g.mu.Lock()
	if g.failed != nil || g.m == nil {
		g.mu.Unlock()
		return
	}
	g.failed = fmt.Errorf("%w: %v", ErrGroupLost, err)
	m := g.m
	// What this process reported and the others may never have seen is
	// applied here, after the loss of the others' ranks.
	unsent := append(g.sent, g.pending...)
	g.sent, g.pending = nil, nil
	failed := g.failed
	g.mu.Unlock()
	g.echo.push(m, append(unsent, m.lost(failed)))
}

func (g *GatherGroup) publish(evs ...instEvent) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.failed != nil {
		g.echo.push(g.m, evs)
		return
	}
	g.pending = append(g.pending, evs...)
}

func (g *GatherGroup) close() error {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.echo.stop()
	return nil
}

// AllGather is an all-gather a Go caller supplies: it contributes b for
// this process and returns every process's contribution, in process order.
type AllGather func(ctx context.Context, b []byte) ([][]byte, error)

// Run drives the group's rounds with allGather, one every interval (0: back
// to back), until ctx ends or a round fails; a failed round breaks the
// group (Fail) and Run returns its error. It returns nil when ctx ends.
func (g *GatherGroup) Run(ctx context.Context, allGather AllGather, interval time.Duration) error {
	var tick *time.Ticker
	if interval > 0 {
		tick = time.NewTicker(interval)
		defer tick.Stop()
	}
	for {
		if ctx.Err() != nil {
			return nil
		}
		all, err := allGather(ctx, g.Outbox())
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			err = fmt.Errorf("transceiver: gather group: round: %w", err)
			g.Fail(err)
			return err
		}
		if err := g.Deliver(all); err != nil {
			return err
		}
		if tick != nil {
			select {
			case <-tick.C:
			case <-ctx.Done():
				return nil
			}
		}
	}
}
