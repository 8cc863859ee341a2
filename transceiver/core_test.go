package transceiver

import (
	"errors"
	"strings"
	"testing"
)

// Script-driven tests of the pure core: each step feeds one event and states
// the effects it must produce, written as the effects' String forms.

type step struct {
	event string
	do    func() []effect
	want  string
}

func runScript(t *testing.T, steps []step) {
	t.Helper()
	for i, s := range steps {
		got := effectsString(s.do())
		if got != s.want {
			t.Fatalf("step %d (%s):\n got  %s\n want %s", i, s.event, got, s.want)
		}
	}
}

func TestCtxCoreScripts(t *testing.T) {
	boom := errors.New("boom")
	t.Run("two gen ranks, both need data", func(t *testing.T) {
		c := newCtxCore()
		exp := []int{0, 1}
		runScript(t, []step{
			{"gen 1 asks", func() []effect { return c.ask(1, exp, true) }, ""},
			{"gen 1 asks again", func() []effect { return c.ask(1, exp, true) }, "refuse(1: generation rank 1 asked twice)"},
			{"gen 0 asks", func() []effect { return c.ask(0, exp, true) }, "ready(0) ready(1) start-send(0) start-send(1)"},
			{"send 1 done", func() []effect { return c.sent(1, nil) }, ""},
			{"send 1 again", func() []effect { return c.sent(1, nil) }, ""},
			{"send 0 done", func() []effect { return c.sent(0, nil) }, "complete(ok)"},
			{"late ask", func() []effect { return c.ask(0, exp, true) }, "refuse(0: the transfer is already done)"},
			{"timeout after done", func() []effect { return c.timeout(ErrTimeout) }, ""},
		})
	})
	t.Run("duplicate-head rank sends nothing", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"gen 0 asks", func() []effect { return c.ask(0, []int{0}, false) }, "ready(0) complete(ok)"},
		})
	})
	t.Run("stranger and disagreement", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"gen 3 not a target", func() []effect { return c.ask(3, []int{0, 1}, true) }, "refuse(3: generation rank 3 is not a target of this context rank (targets [0 1]))"},
			{"gen 0 other layout", func() []effect { return c.ask(0, []int{0}, true) }, "refuse(0: generation ranks of one request disagree on the generation layout)"},
		})
	})
	t.Run("send fails", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"asks", func() []effect { c.ask(0, []int{0, 1}, true); return c.ask(1, []int{0, 1}, true) }, "ready(0) ready(1) start-send(0) start-send(1)"},
			{"send 0 fails", func() []effect { return c.sent(0, boom) }, "abort(1: send to generation rank 0: boom) stop-all complete(error: send to generation rank 0: boom)"},
			{"send 1 reports late", func() []effect { return c.sent(1, nil) }, ""},
		})
	})
	t.Run("timeout while waiting", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"gen 0 asks", func() []effect { return c.ask(0, []int{0, 1}, true) }, ""},
			{"deadline", func() []effect { return c.timeout(ErrTimeout) }, "abort(0: transceiver: transfer timed out) stop-all complete(error: transceiver: transfer timed out)"},
		})
	})
	t.Run("nobody ever comes", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"deadline", func() []effect { return c.timeout(ErrTimeout) }, "stop-all complete(error: transceiver: transfer timed out)"},
		})
	})
	t.Run("peer aborts", func(t *testing.T) {
		c := newCtxCore()
		runScript(t, []step{
			{"asks", func() []effect { c.ask(0, []int{0, 1}, true); return c.ask(1, []int{0, 1}, false) }, "ready(0) ready(1) start-send(0)"},
			{"gen 0 aborts", func() []effect { return c.peerAbort(0, "cancelled") }, "abort(1: transceiver: aborted by peer: generation rank 0: cancelled) stop-all complete(error: transceiver: aborted by peer: generation rank 0: cancelled)"},
		})
	})
	t.Run("cancel", func(t *testing.T) {
		c := newCtxCore()
		effs, ok := c.cancel(ErrCanceled)
		if !ok || effectsString(effs) != "stop-all complete(error: transceiver: transfer cancelled)" {
			t.Fatalf("cancel: %v %s", ok, effectsString(effs))
		}
		if _, ok := c.cancel(ErrCanceled); ok {
			t.Fatal("second cancel reported true")
		}
	})
}

func TestGenCoreScripts(t *testing.T) {
	boom := errors.New("boom")
	t.Run("two sources, one duplicate", func(t *testing.T) {
		g := newGenCore([]int{2, 3}, map[int]bool{2: true})
		runScript(t, []step{
			{"start", g.start, "ask(2) ask(3)"},
			{"3 ready", func() []effect { return g.readied(3) }, ""},
			{"3 ready twice", func() []effect { return g.readied(3) }, ""},
			{"9 is no source", func() []effect { return g.readied(9) }, ""},
			{"2 ready", func() []effect { return g.readied(2) }, "start-recv(2)"},
			{"2 received", func() []effect { return g.received(2, nil) }, "complete(ok)"},
			{"cancel after done", func() []effect { e, _ := g.cancel(ErrCanceled); return e }, ""},
		})
	})
	t.Run("refused", func(t *testing.T) {
		g := newGenCore([]int{0, 1}, map[int]bool{0: true, 1: true})
		runScript(t, []step{
			{"start", g.start, "ask(0) ask(1)"},
			{"0 ready", func() []effect { return g.readied(0) }, "start-recv(0)"},
			{"1 refuses", func() []effect { return g.refused(1, "wrong token") },
				"abort(0: transceiver: refused by context rank 1: wrong token) stop-all complete(error: transceiver: refused by context rank 1: wrong token)"},
			{"0 finishes late", func() []effect { return g.received(0, nil) }, ""},
		})
	})
	t.Run("receive fails", func(t *testing.T) {
		g := newGenCore([]int{0}, map[int]bool{0: true})
		runScript(t, []step{
			{"start", g.start, "ask(0)"},
			{"ready", func() []effect { return g.readied(0) }, "start-recv(0)"},
			{"fails", func() []effect { return g.received(0, boom) }, "stop-all complete(error: receive from context rank 0: boom)"},
		})
	})
	t.Run("timeout", func(t *testing.T) {
		g := newGenCore([]int{0, 1}, map[int]bool{0: true, 1: true})
		g.start()
		got := effectsString(g.timeout(ErrTimeout))
		if !strings.HasPrefix(got, "abort(0: ") || !strings.Contains(got, "abort(1: ") || !strings.HasSuffix(got, "complete(error: transceiver: transfer timed out)") {
			t.Fatalf("timeout: %s", got)
		}
	})
}
