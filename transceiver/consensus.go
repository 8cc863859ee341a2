package transceiver

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Instance consensus: a request completes on the instance when every rank
// that takes part has completed it; the first rank to fail fails it on all
// (the others are cancelled); the ranks' figures add up to the request's.
// This is a pure state machine like the protocol cores: the Transceiver
// feeds it events under its lock and carries out its effects after
// (cancelling a request on ranks, completing the Request). Ranks and
// requests are named by number, never by pointer, so that the same core can
// later agree across processes.

// instKey names a request of the instance: its side and its Request.ID.
type instKey struct {
	side side
	id   uint64
}

func (k instKey) String() string { return fmt.Sprintf("%s/%d", k.side, k.id) }

// rankResult is what a rank reports of its part of a request.
type rankResult struct {
	bytes   int64
	chunks  int
	backend string    // what carried the data; "" when nothing moved
	end     time.Time // when the rank's part ended; zero if unknown
}

// instEvent is an event of the consensus core.
type instEvent interface{ isInstEvent() }

// instEffect is an effect of the consensus core.
type instEffect interface {
	fmt.Stringer
	isInstEffect()
}

// Events of the consensus core.
type (
	// rankDoneEvent: rank finished its part of key, with err.
	rankDoneEvent struct {
		key  instKey
		rank int
		err  error
		res  rankResult
		now  time.Time
	}
	// instCancelEvent: the request is cancelled locally (Cancel).
	instCancelEvent struct {
		key   instKey
		cause error
	}
	// startFailedEvent: ranks could not start their part (the first of
	// them failed with err; the others were never asked). The request fails
	// without being reported by the Check calls: the caller got err.
	startFailedEvent struct {
		key   instKey
		ranks []int
		err   error
		now   time.Time
	}
)

// Effects of the consensus core.
type (
	// cancelRanksEffect: cancel key on ranks, with cause.
	cancelRanksEffect struct {
		key   instKey
		ranks []int
		cause error
	}
	// instCompleteEffect: key is over on the instance. silent: the caller
	// already had the error; the Check calls do not report it.
	instCompleteEffect struct {
		key    instKey
		err    error
		stats  Stats
		silent bool
	}
)

func (rankDoneEvent) isInstEvent()    {}
func (instCancelEvent) isInstEvent()  {}
func (startFailedEvent) isInstEvent() {}

func (cancelRanksEffect) isInstEffect()  {}
func (instCompleteEffect) isInstEffect() {}

func (e cancelRanksEffect) String() string {
	return fmt.Sprintf("cancel %s ranks=%s: %v", e.key, intsString(e.ranks), e.cause)
}

func (e instCompleteEffect) String() string {
	s := fmt.Sprintf("complete %s", e.key)
	if e.silent {
		s += " silent"
	}
	if e.err != nil {
		return s + " error: " + e.err.Error()
	}
	st := e.stats
	return fmt.Sprintf("%s ok bytes=%d chunks=%d backend=%q duration=%v", s, st.Bytes, st.Chunks, st.Backend, st.Duration)
}

// consensus is the instance's view of its requests in flight.
type consensus struct {
	reqs map[instKey]*instReq
}

type instReq struct {
	ranks    []int
	reported map[int]bool
	err      error // the first failure
	silent   bool
	stats    Stats
	start    time.Time
	end      time.Time // the latest end a rank reported
}

func newConsensus() *consensus { return &consensus{reqs: map[instKey]*instReq{}} }

// begin enters a request that ranks (instance rank numbers) take part in.
func (c *consensus) begin(key instKey, ranks []int, now time.Time) error {
	if _, dup := c.reqs[key]; dup {
		return fmt.Errorf("transceiver: request %d is already in flight", key.id)
	}
	if len(ranks) == 0 {
		return fmt.Errorf("transceiver: request %d has no rank to run on", key.id)
	}
	c.reqs[key] = &instReq{ranks: slices.Clone(ranks), reported: map[int]bool{}, start: now}
	return nil
}

// inFlight counts the requests of side in flight, and of them those the
// Check calls will report.
func (c *consensus) inFlight(s side) (all, reported int) {
	for k, r := range c.reqs {
		if k.side == s {
			all++
			if !r.silent {
				reported++
			}
		}
	}
	return all, reported
}

// step feeds one event to the core and returns what to do.
func (c *consensus) step(ev instEvent) []instEffect {
	switch ev := ev.(type) {
	case rankDoneEvent:
		r := c.reqs[ev.key]
		if r == nil || !slices.Contains(r.ranks, ev.rank) || r.reported[ev.rank] {
			return nil // not ours, or late: already counted
		}
		var effs []instEffect
		if ev.err != nil && r.err == nil {
			// Ranks agree: one rank's failure fails the request on all.
			r.err = ev.err
			effs = c.cancelOthers(ev.key, r, ev.rank, fmt.Errorf("%w: rank %d failed: %v", ErrCanceled, ev.rank, ev.err))
		}
		return append(effs, c.report(ev.key, r, ev.rank, ev.res, ev.now)...)
	case instCancelEvent:
		r := c.reqs[ev.key]
		if r == nil {
			return nil
		}
		return c.cancelOthers(ev.key, r, -1, ev.cause)
	case startFailedEvent:
		r := c.reqs[ev.key]
		if r == nil {
			return nil
		}
		r.silent = true
		if r.err == nil {
			r.err = ev.err
		}
		var done []instEffect
		for _, rk := range ev.ranks {
			done = append(done, c.report(ev.key, r, rk, rankResult{}, ev.now)...)
		}
		if len(done) > 0 {
			return done // every rank has reported: nothing left to cancel
		}
		return c.cancelOthers(ev.key, r, -1, fmt.Errorf("%w: another rank failed to start: %v", ErrCanceled, ev.err))
	}
	panic(fmt.Sprintf("transceiver: consensus: unknown event %T", ev))
}

// cancelOthers cancels key on every rank that has not reported, but skip.
func (c *consensus) cancelOthers(key instKey, r *instReq, skip int, cause error) []instEffect {
	var ranks []int
	for _, rk := range r.ranks {
		if rk != skip && !r.reported[rk] {
			ranks = append(ranks, rk)
		}
	}
	if len(ranks) == 0 {
		return nil
	}
	return []instEffect{cancelRanksEffect{key: key, ranks: ranks, cause: cause}}
}

// report counts rank's result; the last one completes the request.
func (c *consensus) report(key instKey, r *instReq, rank int, res rankResult, now time.Time) []instEffect {
	if !slices.Contains(r.ranks, rank) || r.reported[rank] {
		return nil
	}
	r.reported[rank] = true
	r.stats.Bytes += res.bytes
	r.stats.Chunks += res.chunks
	if res.backend != "" {
		r.stats.Backend = res.backend
	}
	if res.end.After(r.end) {
		r.end = res.end
	}
	if len(r.reported) < len(r.ranks) {
		return nil
	}
	delete(c.reqs, key)
	if r.end.IsZero() {
		r.end = now
	}
	r.stats.Duration = r.end.Sub(r.start)
	return []instEffect{instCompleteEffect{key: key, err: r.err, stats: r.stats, silent: r.silent}}
}

func intsString(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}
