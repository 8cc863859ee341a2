package transceiver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// Early asks across processes (askHold): a split context instance whose
// rank 1 is handed a request after a generation rank's ask for it has
// reached rank 1.

// respondOn hands context request id (tokens of l) to process p of s
// only.
func (s *split) respondOn(t *testing.T, p int, id uint64, l *layout.Logical) *Request {
	t.Helper()
	in := s.procs[p]
	nb := layout.NumBlocks(l.Tokens, s.state.Shape.TokensPerBlock)
	b, err := in.pools[0].Allocate(nb)
	if err != nil {
		t.Fatal(err)
	}
	shard, err := layout.Shard(l, s.state, p)
	if err != nil {
		t.Fatal(err)
	}
	for i, blk := range b {
		copy(in.pools[0].Block(blk), shard[i])
	}
	req := &Request{ID: id, Type: ContextOnly, NumTokens: l.Tokens, Blocks: [][]kvcache.BlockID{b}}
	if err := in.t.RespondAndSendAsync(req); err != nil {
		t.Fatalf("process %d: RespondAndSendAsync: %v", p, err)
	}
	in.pools[0].Release(b...)
	return req
}

// eventually polls cond every millisecond until it holds, failing the
// test after within.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(within)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(time.Millisecond)
	}
}

// heldOn is how many asks rank 0 of process p holds.
func (s *split) heldOn(p int) int {
	r := s.procs[p].t.ranks[0]
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hold.len()
}

// logShows reports whether process p's copy of the log shows context
// request id begun and not over for its rank.
func (s *split) logShows(p int, id uint64) bool {
	_, ok := s.procs[p].t.begunElsewhere(id, p)
	return ok
}

func earlyLogical(t *testing.T, st layout.CacheState, tokens int, seed uint64) *layout.Logical {
	l, err := layout.NewLogical(st.Shape, tokens)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(seed)
	return l
}

// TestGroupEarlyAsk: rank 0's process hands the opaque state on at once;
// the generation rank's ask reaches rank 1 before rank 1's process calls
// RespondAndSendAsync, 50 to 500 ms later. Rank 1 holds the ask, and the
// transfer completes bit-exact on every process, in both group modes.
func TestGroupEarlyAsk(t *testing.T) {
	for _, mode := range groupModes {
		for _, delay := range []time.Duration{50 * time.Millisecond, 500 * time.Millisecond} {
			t.Run(fmt.Sprintf("%s/%v", mode.name, delay), func(t *testing.T) {
				cfg := testCfg()
				ctxSt := state(4, 4, 16, 8, kvcache.FP16, 2, 1, false)
				genSt := state(4, 4, 16, 8, kvcache.FP16, 1, 1, false)
				ctxInst := newSplit(t, mode, ctxSt, cfg, 32)
				gen := newInst(t, genSt, cfg, 32)
				const id, tokens = 41, 60
				l := earlyLogical(t, ctxSt, tokens, 5)
				c0 := ctxInst.respondOn(t, 0, id, l)
				// Rank 1's process has applied rank 0's begin (the log is
				// what lets it hold the ask), not been handed the request.
				eventually(t, 10*time.Second, "process 1 applies the begin", func() bool { return ctxInst.logShows(1, id) })
				gb := gen.alloc(t, 0, layout.NumBlocks(tokens, 8))
				greq := &Request{ID: 900, Type: GenerationOnly, Blocks: gb, NumTokens: tokens,
					ContextPhase: &ContextPhaseParams{CtxRequestID: id, OpaqueState: c0.ContextPhase.OpaqueState}}
				if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
					t.Fatal(err)
				}
				eventually(t, 10*time.Second, "rank 1 holds the ask", func() bool { return ctxInst.heldOn(1) == 1 })
				time.Sleep(delay)
				if ended(greq) {
					t.Fatalf("the pull ended before rank 1 was handed the request: %s %v", greq.State(), greq.Err())
				}
				c1 := ctxInst.respondOn(t, 1, id, l)
				waitDone(t, greq, 20*time.Second)
				if greq.State() != DisaggGenerationTransComplete {
					t.Fatalf("pull: %s %v", greq.State(), greq.Err())
				}
				gen.verify(t, l, 0, gb)
				gen.release(t, gb)
				waitAll(t, []*Request{c0, c1}, 10*time.Second)
				for p, c := range []*Request{c0, c1} {
					if c.State() != DisaggContextComplete {
						t.Fatalf("process %d: context request %s %v", p, c.State(), c.Err())
					}
				}
				if n := ctxInst.heldOn(1); n != 0 {
					t.Fatalf("rank 1 still holds %d asks", n)
				}
			})
		}
	}
}

// TestGroupEarlyAskNeverHanded: rank 1's process never calls
// RespondAndSendAsync. The pull fails with an error that says why, not
// before kv_transfer_timeout_ms from the begin (the hold's bound) and not
// much after kv_transfer_timeout_ms from the pull; rank 1 holds nothing
// afterwards, rank 0's blocks go back (newSplit's cleanup counts them),
// and no goroutine is left (TestMain).
func TestGroupEarlyAskNeverHanded(t *testing.T) {
	const timeout = 1500 * time.Millisecond
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg(func(c *config.CacheTransceiver) { c.KVTransferTimeoutMs = int(timeout.Milliseconds()) })
			ctxSt := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
			genSt := state(2, 4, 16, 8, kvcache.FP16, 1, 1, false)
			ctxInst := newSplit(t, mode, ctxSt, cfg, 16)
			gen := newInst(t, genSt, cfg, 16)
			const id, tokens = 42, 30
			l := earlyLogical(t, ctxSt, tokens, 6)
			before := time.Now()
			c0 := ctxInst.respondOn(t, 0, id, l)
			eventually(t, 5*time.Second, "process 1 applies the begin", func() bool { return ctxInst.logShows(1, id) })
			gb := gen.alloc(t, 0, layout.NumBlocks(tokens, 8))
			defer gen.release(t, gb)
			greq := &Request{ID: 901, Type: GenerationOnly, Blocks: gb, NumTokens: tokens,
				ContextPhase: &ContextPhaseParams{CtxRequestID: id, OpaqueState: c0.ContextPhase.OpaqueState}}
			pulled := time.Now()
			if err := gen.t.RequestAndReceiveAsync(greq); err != nil {
				t.Fatal(err)
			}
			eventually(t, 5*time.Second, "rank 1 holds the ask", func() bool { return ctxInst.heldOn(1) == 1 || ended(greq) })
			waitDone(t, greq, timeout+10*time.Second)
			failedAt := time.Now()
			if greq.State() != DisaggTransError {
				t.Fatalf("pull: %s, want an error", greq.State())
			}
			err := greq.Err()
			t.Logf("the pull failed %v after the begin: %v", time.Since(before), err)
			if !strings.Contains(err.Error(), "within") {
				t.Fatalf("the error does not say what was not done in time: %v", err)
			}
			if got := failedAt.Sub(before); got < timeout {
				t.Fatalf("the pull failed %v after the begin, before the hold's bound (%v): %v", got, timeout, err)
			}
			// Slack for a loaded machine under -race: the bound is the
			// generation side's own deadline, timeout from the pull.
			if got := failedAt.Sub(pulled); got > timeout+2*time.Second {
				t.Fatalf("the pull failed %v after it started, kv_transfer_timeout_ms is %v: %v", got, timeout, err)
			}
			eventually(t, 5*time.Second, "rank 1 lets the ask go", func() bool { return ctxInst.heldOn(1) == 0 })
			eventually(t, 5*time.Second, "rank 0 gives its blocks back", func() bool {
				return ctxInst.procs[0].pools[0].FreeBlocks() == ctxInst.procs[0].free[0]
			})
			// Rank 0's process hears how the request ended, and no process
			// keeps it in flight: rank 1's process, which never began it,
			// answers the instance's cancel for its rank.
			waitDone(t, c0, 5*time.Second)
			if c0.State() != DisaggTransError {
				t.Fatalf("process 0: context request %s, want an error", c0.State())
			}
			for p, in := range ctxInst.procs {
				eventually(t, 5*time.Second, fmt.Sprintf("process %d forgets the request", p), func() bool { return in.t.PendingContext() == 0 })
			}
			// Handed the request afterwards, rank 1's process refuses it at
			// once and says why, instead of holding blocks nobody can pull.
			late := &Request{ID: id, Type: ContextOnly, NumTokens: tokens, Blocks: [][]kvcache.BlockID{nil}}
			late.Blocks[0], err = ctxInst.procs[1].pools[0].Allocate(layout.NumBlocks(tokens, 8))
			if err != nil {
				t.Fatal(err)
			}
			lerr := ctxInst.procs[1].t.RespondAndSendAsync(late)
			ctxInst.procs[1].pools[0].Release(late.Blocks[0]...)
			if !errors.Is(lerr, ErrCanceled) || !strings.Contains(fmt.Sprint(lerr), "already ended on the instance") {
				t.Fatalf("a late respond of a request the instance failed: %v, want ErrCanceled saying it already ended", lerr)
			}
			if n := ctxInst.procs[1].t.PendingContext(); n != 0 {
				t.Fatalf("process 1 holds %d context requests after refusing the late one", n)
			}
		})
	}
}

var rankNum = regexp.MustCompile(`context rank \d+`)

// TestHostileEarlyAsk: an ask for an id no rank began (a forged id,
// or a begun id with a forged token that rank 0 refuses) is refused at
// once, with the answer an id that is over gets: it does not tell the
// asker which ids exist. Rank 1 holds nothing afterwards.
func TestHostileEarlyAsk(t *testing.T) {
	for _, mode := range groupModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := testCfg() // 10 s: a refusal "at once" is far below it
			ctxSt := state(2, 4, 16, 8, kvcache.FP16, 2, 1, false)
			genSt := state(2, 4, 16, 8, kvcache.FP16, 1, 1, false)
			ctxInst := newSplit(t, mode, ctxSt, cfg, 16)
			gen := newInst(t, genSt, cfg, 16)
			const id, tokens = 43, 30
			l := earlyLogical(t, ctxSt, tokens, 7)
			c0 := ctxInst.respondOn(t, 0, id, l)
			eventually(t, 5*time.Second, "process 1 applies the begin", func() bool { return ctxInst.logShows(1, id) })
			var op OpaqueState
			if err := op.UnmarshalBinary(c0.ContextPhase.OpaqueState); err != nil {
				t.Fatal(err)
			}
			pull := func(genID uint64, mod func(*OpaqueState)) (time.Duration, error) {
				o := op
				mod(&o)
				b, err := o.MarshalBinary()
				if err != nil {
					t.Fatal(err)
				}
				gb := gen.alloc(t, 0, layout.NumBlocks(tokens, 8))
				defer gen.release(t, gb)
				greq := &Request{ID: genID, Type: GenerationOnly, Blocks: gb, NumTokens: tokens,
					ContextPhase: &ContextPhaseParams{CtxRequestID: o.RequestID, OpaqueState: b}}
				start := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				err = gen.t.RequestAndReceiveSync(ctx, greq)
				return time.Since(start), err
			}
			took, unknown := pull(902, func(o *OpaqueState) { o.RequestID = 4242 })
			if !errors.Is(unknown, ErrRefused) || took > 3*time.Second {
				t.Fatalf("forged id: %v after %v, want a refusal at once", unknown, took)
			}
			took, forged := pull(903, func(o *OpaqueState) { o.Token[0] ^= 1 })
			if !errors.Is(forged, ErrRefused) || took > 3*time.Second {
				t.Fatalf("forged token: %v after %v, want a refusal at once", forged, took)
			}
			eventually(t, 5*time.Second, "rank 1 drops the forged ask", func() bool { return ctxInst.heldOn(1) == 0 })
			// The answers for a forged id and a forged token are the same
			// but for the id: neither says the id exists.
			norm := func(err error, id uint64) string {
				return rankNum.ReplaceAllString(strings.ReplaceAll(err.Error(), fmt.Sprint(id), "N"), "context rank R")
			}
			if a, b := norm(unknown, 4242), norm(forged, id); a != b {
				t.Fatalf("the answers differ:\n forged id:    %v\n forged token: %v", unknown, forged)
			}
			// The request itself is still pullable by its owner.
			ctxInst.respondOn(t, 1, id, l)
			_, ok := pull(904, func(*OpaqueState) {})
			if ok != nil {
				t.Fatalf("the owner's pull after the forged ones: %v", ok)
			}
		})
	}
}

// TestHandoverDropsAsksOfLostConns: an ask held for a request whose
// control connection has left the plane (its Lost not applied to the hold
// yet) is not handed to the request's send core when the rank is handed
// the request: the core would never hear that its asker is gone.
func TestHandoverDropsAsksOfLostConns(t *testing.T) {
	var logs syncbuf.Buffer // the instance's goroutines may log while the test reads
	st := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, st, testCfg(), 16, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })
	r := sender.t.ranks[0]
	const id = 42
	now := time.Now()
	r.mu.Lock()
	r.hold.step(evEarlyAsk{from: route{conn: 999, sendID: id, recvID: 7}, ri: &wire.RequestInfo{CtxRequestID: id, GenRequestID: 7},
		now: now, begun: true, begunAt: now}) // connection 999: never in the plane
	held := r.hold.len()
	r.mu.Unlock()
	if held != 1 {
		t.Fatalf("%d asks held, want 1", held)
	}
	startSend(t, sender, id, 8)
	r.mu.Lock()
	held = r.hold.len()
	r.mu.Unlock()
	if held != 0 {
		t.Errorf("%d asks still held after the handover", held)
	}
	if strings.Contains(logs.String(), "refused request-info") {
		t.Errorf("the ask of a connection gone reached the send core, which answered it:\n%s", logs.String())
	}
}
