package transceiver

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Instance consensus: a request completes on the instance when every rank
// that takes part has completed it; the first rank to fail fails it on all
// (the others are cancelled); the ranks' figures add up to the request's.
//
// A context request's pulls are attempts (see sendCore), named by the
// generation request's id. The consensus decides each: the attempt holds
// when every rank reports its sends of it finished (attemptEndEvent
// without an error), and then every rank releases the blocks and completes
// (commitEffect); it fails at the first rank that reports it failed (a
// failure of the generation side or the link), and then every rank
// abandons it and waits for the next (attemptFailedEffect), the request
// still held. The first of the two decides; later reports of a decided
// attempt change nothing.
//
// This is a pure state machine like the protocol cores: the Transceiver
// feeds it events under its lock and carries out its effects after
// (cancelling a request on ranks, telling ranks the fate of an attempt,
// completing the Request). Ranks and requests are named by number, never by
// pointer, so that the same core can later agree across processes.

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
	// attemptEndEvent: rank's part of pull attempt of key (a context
	// request) ended: its sends finished (err nil), or the attempt failed
	// (err: a failure of the generation side or the link).
	attemptEndEvent struct {
		key     instKey
		rank    int
		attempt uint64
		err     error
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
	// joinBeginEvent: a process of the instance began key on its ranks,
	// which ranks (the instance's) take part in. With the ranks in several
	// processes (see Group) each process that hosts some of them logs one
	// before its ranks' reports: the first enters the request, the others
	// change nothing (a process's own reports follow its begin in the log,
	// so that a request is never entered again after it completed).
	joinBeginEvent struct {
		key   instKey
		ranks []int
		now   time.Time
	}
	// ranksLostEvent: ranks left the instance (their process died, or this
	// process lost the group) with err: every request in flight fails on
	// each of them that has not reported, as if it had reported err.
	ranksLostEvent struct {
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
	// attemptFailedEffect: pull attempt of key failed: ranks abandon it,
	// for cause, and wait for the next.
	attemptFailedEffect struct {
		key     instKey
		attempt uint64
		ranks   []int
		cause   error
	}
	// commitEffect: every rank of key finished the sends of pull attempt:
	// ranks release the blocks and complete.
	commitEffect struct {
		key     instKey
		attempt uint64
		ranks   []int
	}
	// instCompleteEffect: key is over on the instance. silent: the caller
	// already had the error; the Check calls do not report it.
	instCompleteEffect struct {
		key    instKey
		err    error
		stats  Stats
		silent bool
		end    time.Time // the latest end a rank reported
	}
)

func (rankDoneEvent) isInstEvent()    {}
func (instCancelEvent) isInstEvent()  {}
func (startFailedEvent) isInstEvent() {}
func (attemptEndEvent) isInstEvent()  {}
func (joinBeginEvent) isInstEvent()   {}
func (ranksLostEvent) isInstEvent()   {}

func (cancelRanksEffect) isInstEffect()   {}
func (instCompleteEffect) isInstEffect()  {}
func (attemptFailedEffect) isInstEffect() {}
func (commitEffect) isInstEffect()        {}

func (e attemptFailedEffect) String() string {
	return fmt.Sprintf("attempt-failed %s attempt=%d ranks=%s: %v", e.key, e.attempt, intsString(e.ranks), e.cause)
}

func (e commitEffect) String() string {
	return fmt.Sprintf("commit %s attempt=%d ranks=%s", e.key, e.attempt, intsString(e.ranks))
}

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

	// Pull attempts (context requests).
	sent      map[int]uint64 // by rank: the attempt whose sends it finished, not decided yet
	failed    []uint64       // the attempts that failed
	committed uint64         // the attempt that held; 0: none yet
}

func newConsensus() *consensus { return &consensus{reqs: map[instKey]*instReq{}} }

// begin enters a request that ranks (instance rank numbers) take part in.
func (c *consensus) begin(key instKey, ranks []int, now time.Time) error {
	if _, dup := c.reqs[key]; dup {
		return invalidRequest("transceiver: request %d is already in flight", key.id)
	}
	if len(ranks) == 0 {
		return fmt.Errorf("transceiver: request %d has no rank to run on", key.id)
	}
	c.reqs[key] = &instReq{ranks: slices.Clone(ranks), reported: map[int]bool{}, start: now, sent: map[int]uint64{}}
	return nil
}

// begunElsewhere reports whether context request id is in flight on the
// instance, taken part in by rank, not failed, not committed and not
// reported by rank: an ask for it that reaches rank before rank holds it
// may be held (see askHold). start is when the request was begun.
func (c *consensus) begunElsewhere(id uint64, rank int) (start time.Time, ok bool) {
	r := c.reqs[instKey{sideSend, id}]
	if r == nil || r.err != nil || r.committed != 0 || r.reported[rank] || !slices.Contains(r.ranks, rank) {
		return time.Time{}, false
	}
	return r.start, true
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
	case attemptEndEvent:
		return c.attemptEnd(ev)
	case joinBeginEvent:
		if _, ok := c.reqs[ev.key]; ok || len(ev.ranks) == 0 {
			return nil
		}
		c.reqs[ev.key] = &instReq{ranks: slices.Clone(ev.ranks), reported: map[int]bool{}, start: ev.now, sent: map[int]uint64{}}
		return nil
	case ranksLostEvent:
		return c.ranksLost(ev)
	case startFailedEvent:
		return c.startFailed(ev)
	}
	panic(fmt.Sprintf("transceiver: consensus: unknown event %T", ev))
}

// ranksLost fails, on behalf of the ranks lost, every request they had
// not reported, in key order, so that every process replaying the same log
// produces the same effects in the same order.
func (c *consensus) ranksLost(ev ranksLostEvent) []instEffect {
	keys := slices.SortedFunc(maps.Keys(c.reqs), func(a, b instKey) int {
		return cmp.Or(cmp.Compare(a.side, b.side), cmp.Compare(a.id, b.id))
	})
	var effs []instEffect
	for _, k := range keys {
		r := c.reqs[k]
		var lost, others []int
		for _, rk := range r.ranks {
			switch {
			case r.reported[rk]:
			case slices.Contains(ev.ranks, rk):
				lost = append(lost, rk)
			default:
				others = append(others, rk)
			}
		}
		if len(lost) == 0 {
			continue
		}
		if r.err == nil {
			r.err = ev.err
			if len(others) > 0 {
				effs = append(effs, cancelRanksEffect{key: k, ranks: others,
					cause: fmt.Errorf("%w: rank %d failed: %v", ErrCanceled, lost[0], ev.err)})
			}
		}
		for _, rk := range lost {
			effs = append(effs, c.report(k, r, rk, rankResult{}, ev.now)...)
		}
	}
	return effs
}

// startFailed records that the ranks ev names could not start a request:
// they report it failed, silently (the caller has its error), and the
// others are cancelled.
func (c *consensus) startFailed(ev startFailedEvent) []instEffect {
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

// attemptEnd decides a pull attempt: the first failure reported fails it;
// the last rank to finish its sends makes it hold.
func (c *consensus) attemptEnd(ev attemptEndEvent) []instEffect {
	r := c.reqs[ev.key]
	if r == nil || ev.attempt == 0 || !slices.Contains(r.ranks, ev.rank) || r.reported[ev.rank] || r.err != nil ||
		r.committed != 0 || slices.Contains(r.failed, ev.attempt) {
		return nil // not ours, over, failing, or decided already
	}
	if ev.err != nil {
		r.failed = append(r.failed, ev.attempt)
		for rk, a := range r.sent {
			if a == ev.attempt {
				delete(r.sent, rk)
			}
		}
		return []instEffect{attemptFailedEffect{key: ev.key, attempt: ev.attempt, ranks: c.unreported(r), cause: ev.err}}
	}
	r.sent[ev.rank] = ev.attempt
	for _, rk := range r.ranks {
		if r.sent[rk] != ev.attempt {
			return nil
		}
	}
	r.committed = ev.attempt
	return []instEffect{commitEffect{key: ev.key, attempt: ev.attempt, ranks: c.unreported(r)}}
}

// unreported lists the ranks of r that have not reported its end.
func (c *consensus) unreported(r *instReq) []int {
	var ranks []int
	for _, rk := range r.ranks {
		if !r.reported[rk] {
			ranks = append(ranks, rk)
		}
	}
	return ranks
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
	return []instEffect{instCompleteEffect{key: key, err: r.err, stats: r.stats, silent: r.silent, end: r.end}}
}

func intsString(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}
