package transceiver

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

func TestHoldScripts(t *testing.T) {
	runScripts(t, "testdata/hold/*.script", func() func(*testing.T, *scriptCmd) string { return (&holdInterp{}).run })
}

// holdInterp runs a rank's ask hold (core_hold.go).
type holdInterp struct{ h *askHold }

func (in *holdInterp) run(t *testing.T, c *scriptCmd) string {
	if c.name != "new-hold" && in.h == nil {
		t.Fatalf("%s: new-hold first", c.pos)
	}
	switch c.name {
	case "new-hold":
		// new-hold [rank=1] [timeout=10s]
		in.h = newAskHold(c.int(t, "rank", 1), c.dur(t, "timeout", 10*time.Second))
		return ""
	case "ask":
		// ask [id=7] [gen=0] [conn=1] [req=100] [at=0s] [begun] [begun-at=]:
		// an ask for a request the rank does not hold; begun: the log
		// shows it begun (at begun-at, default the ask's time).
		from := route{conn: connID(c.int(t, "conn", 1)), sendID: uint64(c.int(t, "id", scriptSendID)), recvID: uint64(c.int(t, "req", 100))}
		ri := &wire.RequestInfo{CtxRequestID: from.sendID, Token: scriptToken, GenRequestID: from.recvID, GenRank: uint32(c.int(t, "gen", 0))}
		ev := evEarlyAsk{from: from, ri: ri, now: scriptAt(t, c), begun: c.flag("begun")}
		if c.has("begun-at") {
			ev.begunAt = scriptT0.Add(c.dur(t, "begun-at", 0))
		}
		return in.print(in.h.step(ev))
	case "handed-over":
		return in.print(in.h.step(evHandedOver{id: uint64(c.int(t, "id", scriptSendID))}))
	case "ended":
		return in.print(in.h.step(evHeldEnded{id: uint64(c.int(t, "id", scriptSendID)), err: orDefault(scriptErr(c, "err"), ErrCanceled)}))
	case "abort":
		return in.print(in.h.step(evHeldAbort{from: route{conn: connID(c.int(t, "conn", 1)), recvID: uint64(c.int(t, "req", 100))}}))
	case "conn-lost":
		return in.print(in.h.step(evConnLost{conn: connID(c.int(t, "conn", 1)), err: errors.New("peer lost")}))
	case "tick":
		return in.print(in.h.step(evTick{now: scriptAt(t, c)}))
	case "close":
		return in.print(in.h.step(evCancel{err: ErrClosed}))
	case "held":
		return fmt.Sprintf("held %d on conns %v", in.h.len(), in.h.conns())
	}
	t.Fatalf("%s: unknown command %s", c.pos, c.name)
	return ""
}

func (in *holdInterp) print(effs []effect) string {
	var lines []string
	for _, e := range effs {
		line := describe(e)
		switch e := e.(type) {
		case effRefuse:
			line += fmt.Sprintf(" [conn=%d req=%d]", e.to.conn, e.to.recvID)
		case effTakeAsk:
			line += fmt.Sprintf(" [conn=%d req=%d]", e.from.conn, e.from.recvID)
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// TestHoldBounds: whatever the events, the hold never keeps more than its
// bounds, an ask leaves it exactly once (taken, refused or dropped), and no
// ask outlives its deadline once a tick at or after it came: checked
// against a naive model of the same rules on random event sequences.
func TestHoldBounds(t *testing.T) {
	type naiveAsk struct {
		conn  connID
		req   uint64
		id    uint64
		until time.Time
	}
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 11))
		h := newAskHold(1, time.Duration(1+rng.IntN(5))*time.Second)
		var model []naiveAsk
		now := scriptT0
		for step := range 400 {
			now = now.Add(time.Duration(rng.IntN(300)) * time.Millisecond)
			conn, id, req := connID(1+rng.IntN(3)), uint64(1+rng.IntN(4)), uint64(100+rng.IntN(3))
			var effs []effect
			var gone []naiveAsk // what the model says leaves, answered or taken
			switch k := rng.IntN(10); {
			case k < 6:
				begun := rng.IntN(4) > 0
				ri := &wire.RequestInfo{CtxRequestID: id, GenRequestID: req}
				effs = h.step(evEarlyAsk{from: route{conn: conn, sendID: id, recvID: req}, ri: ri, now: now, begun: begun})
				perConn := 0
				for _, a := range model {
					if a.conn == conn {
						perConn++
					}
				}
				if !begun || perConn >= maxHeldPerConn || len(model) >= maxHeldAsks {
					gone = append(gone, naiveAsk{conn: conn, req: req, id: id})
				} else {
					model = append(model, naiveAsk{conn: conn, req: req, id: id, until: now.Add(h.timeout)})
				}
			case k == 6:
				effs = h.step(evHandedOver{id: id})
				model = slices.DeleteFunc(model, func(a naiveAsk) bool {
					if a.id == id {
						gone = append(gone, a)
					}
					return a.id == id
				})
			case k == 7:
				effs = h.step(evHeldEnded{id: id, err: ErrCanceled})
				model = slices.DeleteFunc(model, func(a naiveAsk) bool {
					if a.id == id {
						gone = append(gone, a)
					}
					return a.id == id
				})
			case k == 8:
				effs = h.step(evConnLost{conn: conn})
				model = slices.DeleteFunc(model, func(a naiveAsk) bool { return a.conn == conn })
			default:
				effs = h.step(evTick{now: now})
				model = slices.DeleteFunc(model, func(a naiveAsk) bool {
					if !now.Before(a.until) {
						gone = append(gone, a)
					}
					return !now.Before(a.until)
				})
			}
			answered := 0
			for _, e := range effs {
				switch e.(type) {
				case effRefuse, effTakeAsk:
					answered++
				}
			}
			if answered != len(gone) || h.len() != len(model) {
				t.Fatalf("seed %d step %d: %d answered, model %d; %d held, model %d", seed, step, answered, len(gone), h.len(), len(model))
			}
			if h.len() > maxHeldAsks {
				t.Fatalf("seed %d: %d held, bound %d", seed, h.len(), maxHeldAsks)
			}
		}
	}
}

// TestHostileHeldAskFlood: a flood of asks for requests begun on other ranks is held
// up to maxHeldPerConn a connection and maxHeldAsks in all; past either,
// each gets the unknown answer at once; the memory goes when the
// connections do.
func TestHostileHeldAskFlood(t *testing.T) {
	h := newAskHold(1, time.Minute)
	ask := func(conn connID, id uint64) []effect {
		ri := &wire.RequestInfo{CtxRequestID: id, GenRequestID: 100}
		return h.step(evEarlyAsk{from: route{conn: conn, sendID: id, recvID: 100}, ri: ri, now: scriptT0, begun: true})
	}
	refused := func(effs []effect) bool {
		for _, e := range effs {
			if r, ok := e.(effRefuse); ok && r.code == wire.RefusedUnknown && strings.Contains(r.note, "held-ask bound") {
				return true
			}
		}
		return false
	}
	for i := range maxHeldPerConn + 10 {
		if got := refused(ask(1, uint64(i))); got != (i >= maxHeldPerConn) {
			t.Fatalf("ask %d on one connection: refused %v", i, got)
		}
	}
	if h.len() != maxHeldPerConn {
		t.Fatalf("%d held on one connection, want %d", h.len(), maxHeldPerConn)
	}
	conns := connID(2)
	for n := h.len(); n < maxHeldAsks; n++ {
		if refused(ask(conns, uint64(n))) {
			t.Fatalf("ask %d refused below the total bound", n)
		}
		if (n+1)%maxHeldPerConn == 0 {
			conns++
		}
	}
	if !refused(ask(conns+1, 1<<40)) || h.len() != maxHeldAsks {
		t.Fatalf("past the total bound: %d held, want %d and a refusal", h.len(), maxHeldAsks)
	}
	for c := connID(1); c <= conns+1; c++ {
		if effs := h.step(evConnLost{conn: c}); len(effs) != 0 {
			t.Fatalf("a lost connection's asks got answers: %v", effs)
		}
	}
	if h.len() != 0 || len(h.conns()) != 0 || h.asks != nil {
		t.Fatalf("after the connections went: %d held on %v", h.len(), h.conns())
	}
}

// TestFrameEvent: what each control frame means to the cores, on each
// side of a connection; a frame on the wrong side breaks the protocol.
func TestFrameEvent(t *testing.T) {
	ri := &wire.RequestInfo{CtxRequestID: 7, GenRequestID: 9}
	at := route{conn: 3, sendID: 7, recvID: 9}
	for _, tc := range []struct {
		f       wire.Frame
		dialled bool
		key     reqKey
		ev      event
		held    event
		bad     bool
	}{
		{f: &wire.Ready{CtxRequestID: 7, GenRequestID: 9, ChunkBlocks: 4}, dialled: true, key: reqKey{sideRecv, 9}, ev: evReady{conn: 3, src: 1, chunk: 4}},
		{f: &wire.Refused{GenRequestID: 9, Reason: "no"}, dialled: true, key: reqKey{sideRecv, 9}, ev: evRefused{conn: 3, src: 1, reason: "no"}},
		{f: &wire.Abort{GenRequestID: 9, Reason: "x"}, dialled: true, key: reqKey{sideRecv, 9}, ev: evSrcAbort{conn: 3, src: 1, reason: "x"}},
		{f: &wire.Pong{}, dialled: true},
		{f: ri, dialled: true, bad: true},
		{f: ri, key: reqKey{sideSend, 7}, ev: evAsk{from: at, ri: ri, now: scriptT0}, held: evEarlyAsk{from: at, ri: ri, now: scriptT0}},
		{f: &wire.ChunkDesc{CtxRequestID: 7, GenRequestID: 9, Index: 2}, key: reqKey{sideSend, 7}, ev: evChunkDesc{from: at, index: 2}},
		{f: &wire.Abort{CtxRequestID: 7, GenRequestID: 9, Reason: "x"}, key: reqKey{sideSend, 7}, ev: evGenAbort{from: at, reason: "x"}, held: evHeldAbort{from: at}},
		{f: &wire.Ready{}, bad: true},
		{f: &wire.Pong{}, bad: true},
	} {
		key, ev, held, err := frameEvent(tc.f, 3, 1, tc.dialled, scriptT0)
		name := fmt.Sprintf("%s dialled=%v", tc.f.Type(), tc.dialled)
		if (err != nil) != tc.bad || (err != nil && !errors.Is(err, wire.ErrMalformed)) {
			t.Errorf("%s: err %v, want bad=%v", name, err, tc.bad)
			continue
		}
		if key != tc.key || fmt.Sprintf("%#v", ev) != fmt.Sprintf("%#v", tc.ev) || fmt.Sprintf("%#v", held) != fmt.Sprintf("%#v", tc.held) {
			t.Errorf("%s: got %v %#v %#v, want %v %#v %#v", name, key, ev, held, tc.key, tc.ev, tc.held)
		}
	}
}
