package transceiver

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// askHold is the pure core of one context rank's early asks: request-infos
// for a context request this rank has not been handed yet. With the ranks
// of an instance in several processes (see Group), each process calls
// RespondAndSendAsync at its own time, and the opaque state one of them
// hands out may bring a generation rank's ask to this rank before this
// process has called it. TensorRT-LLM's sender waits for such a request to
// become ready; so does this one, within bounds:
//
//   - An ask is held only when the instance's consensus log, as applied in
//     this process, shows the context request begun on the instance, not
//     failed, not committed and not reported by this rank (begun in
//     evEarlyAsk). That record is the instance's own, so a stranger cannot
//     forge it; any other ask gets the answer an unknown id gets, at once.
//   - It is held until the request's deadline: kv_transfer_timeout from the
//     begin the log recorded (from the ask if that is earlier), then
//     refused with a reason that says so.
//   - At most maxHeldPerConn asks a control connection and maxHeldAsks in
//     all; past either, the ask gets the unknown answer at once (the log
//     says why), so that a flood of asks cannot hold memory or tell more
//     than the holding does.
//   - When this rank is handed the request (evHandedOver), its held asks
//     go to the request's send core, in the order they came; the token and
//     every other check happen there, as for any ask.
//   - When the request ends on the instance before (evHeldEnded: failed,
//     cancelled, its other ranks lost), its asks are refused with the code
//     an unknown id gets and a reason that gives the instance's cause;
//     when an asker goes (its connection lost, its abort), its asks are
//     dropped.
//
// Like the other cores it does no I/O, starts no goroutine, takes no lock
// and reads no clock: the driver feeds it events under the rank's lock and
// carries out its effects, arming one timer a rank for its deadline.
type askHold struct {
	rank    int
	timeout time.Duration // kv_transfer_timeout
	asks    []heldAsk     // in the order they came
	armed   time.Time     // the tick asked for last; zero: none
}

// maxHeldPerConn and maxHeldAsks bound the asks a rank holds (askHold).
const (
	maxHeldPerConn = 64
	maxHeldAsks    = 1024
)

// heldAsk is an ask kept until its request reaches this rank.
type heldAsk struct {
	from  route
	ri    *wire.RequestInfo
	until time.Time
}

func newAskHold(rank int, timeout time.Duration) *askHold {
	return &askHold{rank: rank, timeout: timeout}
}

// Events of the hold (besides evTick and evConnLost).
type (
	// evEarlyAsk: a request-info arrived at now for a context request
	// this rank does not hold. begun: the instance's log shows it begun
	// on another rank and not over, at begunAt.
	evEarlyAsk struct {
		from    route
		ri      *wire.RequestInfo
		now     time.Time
		begun   bool
		begunAt time.Time
	}
	// evHandedOver: this rank was handed context request id.
	evHandedOver struct{ id uint64 }
	// evHeldEnded: context request id ended on the instance (failed,
	// cancelled) before this rank was handed it, for err.
	evHeldEnded struct {
		id  uint64
		err error
	}
	// evHeldAbort: the generation rank at from aborted its pull.
	evHeldAbort struct{ from route }
)

// effTakeAsk: feed this held ask to the send core of its request, which
// this rank now holds.
type effTakeAsk struct {
	from route
	ri   *wire.RequestInfo
}

func (evEarlyAsk) isEvent()   {}
func (evHandedOver) isEvent() {}
func (evHeldEnded) isEvent()  {}
func (evHeldAbort) isEvent()  {}
func (effTakeAsk) isEffect()  {}

func (e effTakeAsk) String() string {
	return fmt.Sprintf("take-ask gen=%d request=%d", e.ri.GenRank, e.ri.CtxRequestID)
}

// state is the hold's phase: waiting, for as long as the rank lives.
func (h *askHold) state() phase { return phaseWaiting }

// len is how many asks the rank holds.
func (h *askHold) len() int { return len(h.asks) }

// conns lists the control connections of the held asks: they are not idle.
func (h *askHold) conns() []connID {
	var out []connID
	for _, a := range h.asks {
		if !slices.Contains(out, a.from.conn) {
			out = append(out, a.from.conn)
		}
	}
	return out
}

func (h *askHold) step(ev event) []effect {
	effs := h.apply(ev)
	if len(h.asks) == 0 {
		h.asks = nil // the memory of a flood goes with it
	}
	return effs
}

func (h *askHold) apply(ev event) []effect {
	switch ev := ev.(type) {
	case evEarlyAsk:
		return h.early(ev)
	case evHandedOver:
		var effs []effect
		h.asks = slices.DeleteFunc(h.asks, func(a heldAsk) bool {
			if a.ri.CtxRequestID != ev.id {
				return false
			}
			effs = append(effs, effTakeAsk{from: a.from, ri: a.ri})
			return true
		})
		return effs
	case evHeldEnded:
		return h.refuse(func(a heldAsk) bool { return a.ri.CtxRequestID == ev.id }, func(a heldAsk) effect {
			return effRefuse{gen: int(a.ri.GenRank), to: a.from, code: wire.RefusedUnknown,
				reason: fmt.Sprintf("context request %d ended on the instance before context rank %d was handed it: %v", a.ri.CtxRequestID, h.rank, ev.err)}
		})
	case evHeldAbort:
		h.drop(func(a heldAsk) bool { return a.from.conn == ev.from.conn && a.from.recvID == ev.from.recvID })
		return nil
	case evConnLost:
		h.drop(func(a heldAsk) bool { return a.from.conn == ev.conn })
		return nil
	case evTick:
		h.armed = time.Time{}
		effs := h.refuse(func(a heldAsk) bool { return !ev.now.Before(a.until) }, func(a heldAsk) effect {
			return effRefuse{gen: int(a.ri.GenRank), to: a.from, code: wire.RefusedUnknown,
				reason: fmt.Sprintf("context request %d was begun on the instance but not handed to context rank %d within kv_transfer_timeout_ms=%d",
					a.ri.CtxRequestID, h.rank, h.timeout.Milliseconds())}
		})
		return append(effs, h.arm()...)
	case evCancel:
		h.asks, h.armed = nil, time.Time{}
		return nil
	}
	panic(fmt.Sprintf("transceiver: ask hold: unexpected event %T", ev))
}

// early decides an ask for a request this rank does not hold.
func (h *askHold) early(ev evEarlyAsk) []effect {
	if !ev.begun {
		return []effect{refuseUnknown(h.rank, ev.from, ev.ri, "")}
	}
	perConn := 0
	for _, a := range h.asks {
		if a.from.conn == ev.from.conn {
			perConn++
		}
	}
	if perConn >= maxHeldPerConn || len(h.asks) >= maxHeldAsks {
		return []effect{refuseUnknown(h.rank, ev.from, ev.ri, fmt.Sprintf("held-ask bound reached (%d on the connection, %d on the rank)", perConn, len(h.asks)))}
	}
	start := ev.now
	if !ev.begunAt.IsZero() && ev.begunAt.Before(start) {
		start = ev.begunAt
	}
	until := start.Add(h.timeout)
	h.asks = append(h.asks, heldAsk{from: ev.from, ri: ev.ri, until: until})
	if !ev.now.Before(until) {
		return h.apply(evTick{now: ev.now})
	}
	return h.arm()
}

// arm asks for the tick of the earliest held ask's deadline, unless one no
// later is armed already.
func (h *askHold) arm() []effect {
	if len(h.asks) == 0 {
		return nil
	}
	first := h.asks[0].until
	for _, a := range h.asks[1:] {
		if a.until.Before(first) {
			first = a.until
		}
	}
	if !h.armed.IsZero() && !first.Before(h.armed) {
		return nil
	}
	h.armed = first
	return []effect{effArmTimer{at: first}}
}

// refuse removes the asks match selects and returns answer's effect for
// each.
func (h *askHold) refuse(match func(heldAsk) bool, answer func(heldAsk) effect) []effect {
	var effs []effect
	h.asks = slices.DeleteFunc(h.asks, func(a heldAsk) bool {
		if !match(a) {
			return false
		}
		effs = append(effs, answer(a))
		return true
	})
	return effs
}

// drop removes the asks match selects, with no answer: their asker is gone.
func (h *askHold) drop(match func(heldAsk) bool) {
	h.asks = slices.DeleteFunc(h.asks, match)
}
