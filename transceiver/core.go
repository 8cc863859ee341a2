package transceiver

import (
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// The pure core of the transfer protocol: one state machine per request per
// rank and side (sendCore in core_send.go, recvCore in core_recv.go). A
// core performs no I/O, starts no goroutines, takes no lock and reads no
// clock: the driver (rank.go) feeds it typed events, the time included, and
// carries out the effects it returns, every reply on the wire included. The
// instance-level agreement of the ranks is a third core (consensus.go).
// Script tests (script_test.go, testdata/*.script) run the cores without
// any network.

// side is the role of an instance in a transfer.
type side uint8

const (
	sideSend side = iota // the context (prefill) instance: holds the KV cache, sends it
	sideRecv             // the generation instance: pulls it into its own blocks
	sideHold             // a context rank's ask hold (askHold), among its requests
)

func (s side) String() string { return [...]string{"send", "recv", "hold"}[s] }

// connID names one of a rank's control connections (0: none yet).
type connID uint64

// route addresses the frames of one pair of ranks: the control connection
// and the two ids every frame of a transfer carries.
type route struct {
	conn   connID
	sendID uint64 // the context request's id (wire CtxRequestID)
	recvID uint64 // the receiving rank's id of the transfer (wire GenRequestID)
}

// phase is where a core stands.
type phase uint8

const (
	phaseWaiting phase = iota // send: waiting for the generation ranks to ask; recv: asking
	phaseMoving               // data is moving
	phaseSent                 // send: this rank's sends of the attempt finished; the blocks are held until the instance agrees
	phaseDone                 // every byte moved
	phaseFailed               // ended with an error
)

func (p phase) String() string {
	return [...]string{"waiting", "moving", "sent", "done", "failed"}[p]
}

func (p phase) over() bool { return p == phaseDone || p == phaseFailed }

// protocolCore is what the driver needs of either side's core.
type protocolCore interface {
	step(ev event) []effect
	state() phase
	// conns lists the control connections the request's peers are on:
	// while it is in flight they are not idle.
	conns() []connID
}

// An event is something that happened to a request: a frame arrived, a
// send or receive ended, the deadline tick came, the caller cancelled.
type event interface{ isEvent() }

// An effect is one thing the driver must do for a request.
type effect interface {
	fmt.Stringer
	isEffect()
}

// Events of both sides.
type (
	// evStart: the request was handed to the rank at now.
	evStart struct{ now time.Time }
	// evTick: the clock says now; the deadline may have passed.
	evTick struct{ now time.Time }
	// evCancel: the request is cancelled (locally, or the rank closes).
	evCancel struct{ err error }
	// evConnLost: control connection conn broke with err.
	evConnLost struct {
		conn connID
		err  error
	}
)

// reply is an effect that is one control frame to a peer (effRefuse,
// effReady, effAbort): the core says which frame, the driver writes it on
// the route's connection.
type reply interface {
	effect
	dest() route
	frame() wire.Frame
}

// Effects of both sides.
type (
	// effArmTimer: send an evTick at at (the request's deadline due
	// next). It replaces the timer armed before, if any: a request has one.
	effArmTimer struct{ at time.Time }
	// effAbort: tell peer (by rank) that the transfer failed. A zero
	// to.conn: the peer was never reached; nothing to send.
	effAbort struct {
		side   side // whose core: the peer is a generation rank (send) or a context rank (recv)
		peer   int
		to     route
		reason string
	}
	// effStopAll: stop every send or receive of the request in progress.
	effStopAll struct{}
	// effRelease: once no send or receive touches the blocks any more,
	// give them back (send: the references held; recv: take them back from
	// receipts armed for a direct transfer).
	effRelease struct{}
	// effComplete: the request is over on this rank; err nil or not.
	effComplete struct{ err error }
)

func (evStart) isEvent()    {}
func (evTick) isEvent()     {}
func (evCancel) isEvent()   {}
func (evConnLost) isEvent() {}

func (effArmTimer) isEffect() {}
func (effAbort) isEffect()    {}
func (effStopAll) isEffect()  {}
func (effRelease) isEffect()  {}
func (effComplete) isEffect() {}

func (e effAbort) dest() route { return e.to }
func (e effAbort) frame() wire.Frame {
	return &wire.Abort{CtxRequestID: e.to.sendID, GenRequestID: e.to.recvID, Reason: e.reason}
}

func (e effArmTimer) String() string { return "arm-timer at=" + e.at.Format(time.RFC3339Nano) }
func (e effAbort) String() string {
	return fmt.Sprintf("abort %s: %s", peerName(e.side, e.peer), e.reason)
}
func (effStopAll) String() string { return "stop-all" }
func (effRelease) String() string { return "release-blocks" }
func (e effComplete) String() string {
	if e.err != nil {
		return "complete error: " + e.err.Error()
	}
	return "complete ok"
}

// deadline is a core's deadline, set at its start, and a second one a
// core may set later (the send side's sender timeout, from the start of its
// sends), kept only when it comes first. The driver keeps one timer per
// request, the one armed last, so the deadline asks for the tick of
// whichever is due next, and every early tick asks for it again.
type deadline struct {
	at     time.Time // set at the start
	second time.Time // zero: none, or not before at
}

// start sets the deadline timeout after now and asks for its tick.
func (d *deadline) start(now time.Time, timeout time.Duration) effect {
	d.at = now.Add(timeout)
	return effArmTimer{at: d.at}
}

// startSecond sets the second deadline timeout after now and asks for its
// tick, unless the first one comes no later (then it has no effect).
func (d *deadline) startSecond(now time.Time, timeout time.Duration) []effect {
	at := now.Add(timeout)
	if !d.at.IsZero() && !at.Before(d.at) {
		return nil
	}
	d.second = at
	return []effect{effArmTimer{at: at}}
}

// tick handles a core's evTick: nothing once the core is over (a late
// tick), a re-armed tick for the deadline due next when now is before both
// (an early one), else the core's expiry, second telling which deadline
// passed (the second one comes first when set).
func (d *deadline) tick(now time.Time, over bool, expire func(second bool) []effect) []effect {
	switch {
	case over:
		return nil
	case !d.second.IsZero() && !now.Before(d.second):
		return expire(true)
	case now.Before(d.at):
		if !d.second.IsZero() {
			return []effect{effArmTimer{at: d.second}}
		}
		return []effect{effArmTimer{at: d.at}}
	}
	return expire(false)
}

// frameEvent is what a control frame that arrived at now on connection
// conn, from peer rank src, means to the rank's cores: the request it is
// about (key), the event for that request's core (ev; nil: none, a Pong),
// and, for a request the rank does not hold, the event for its ask hold
// (held; nil: the frame is dropped). dialled: the rank dialled conn, to a
// context rank, so the frame is about one of its receives; else it came
// from a generation rank, about a send. A frame of another type, or on the
// wrong side, breaks the protocol (err).
func frameEvent(f wire.Frame, conn connID, src int, dialled bool, now time.Time) (key reqKey, ev, held event, err error) {
	if dialled {
		switch f := f.(type) {
		case *wire.Ready:
			return reqKey{sideRecv, f.GenRequestID}, evReady{conn: conn, src: src, chunk: int(f.ChunkBlocks)}, nil, nil
		case *wire.Refused:
			return reqKey{sideRecv, f.GenRequestID}, evRefused{conn: conn, src: src, reason: f.Reason}, nil, nil
		case *wire.Abort:
			return reqKey{sideRecv, f.GenRequestID}, evSrcAbort{conn: conn, src: src, reason: f.Reason}, nil, nil
		case *wire.Pong:
			return reqKey{}, nil, nil, nil
		}
		return reqKey{}, nil, nil, fmt.Errorf("%w: unexpected %s frame from a context rank", wire.ErrMalformed, f.Type())
	}
	switch f := f.(type) {
	case *wire.RequestInfo:
		at := route{conn: conn, sendID: f.CtxRequestID, recvID: f.GenRequestID}
		return reqKey{sideSend, f.CtxRequestID}, evAsk{from: at, ri: f, now: now}, evEarlyAsk{from: at, ri: f, now: now}, nil
	case *wire.ChunkDesc:
		at := route{conn: conn, sendID: f.CtxRequestID, recvID: f.GenRequestID}
		return reqKey{sideSend, f.CtxRequestID}, evChunkDesc{from: at, index: int(f.Index), desc: f.Desc}, nil, nil
	case *wire.Abort:
		at := route{conn: conn, sendID: f.CtxRequestID, recvID: f.GenRequestID}
		return reqKey{sideSend, f.CtxRequestID}, evGenAbort{from: at, reason: f.Reason}, evHeldAbort{from: at}, nil
	}
	return reqKey{}, nil, nil, fmt.Errorf("%w: unexpected %s frame from a generation rank", wire.ErrMalformed, f.Type())
}

// peerName names the peer of a side's core in scripts and logs: the
// generation rank of a send, the source (context rank) of a receive.
func peerName(s side, peer int) string {
	if s == sideSend {
		return fmt.Sprintf("gen=%d", peer)
	}
	return fmt.Sprintf("src=%d", peer)
}
