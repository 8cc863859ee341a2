package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transceiver"
)

// newTestEngine builds an aggregated engine (no transceiver) closed at the
// end of the test; Close fails the test if blocks leaked.
func newTestEngine(t testing.TB, preset string, icfg InstanceConfig, opts Options) *Engine {
	t.Helper()
	in, err := NewInstance(testModel(t, preset), icfg)
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(in, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("engine close: %v", err)
		}
	})
	return e
}

func submit(t testing.TB, e *Engine, ctx context.Context, req Request) *Stream {
	t.Helper()
	s, err := e.Submit(ctx, req)
	if err != nil {
		t.Fatalf("Submit: %v", err)
	}
	return s
}

// waitResult collects a stream, failing the test if it takes too long.
func waitResult(t testing.TB, s *Stream) Result {
	t.Helper()
	ch := make(chan Result, 1)
	go func() { ch <- s.Wait() }()
	select {
	case r := <-ch:
		return r
	case <-time.After(60 * time.Second):
		t.Fatalf("request %d: no final event within 60s", s.ID())
		return Result{}
	}
}

// waitPoolsFree waits until no block of e's instance is pinned (a context
// side's transceiver releases its blocks shortly after the pull).
func waitPoolsFree(t testing.TB, e *Engine) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pinned := 0
		for _, p := range e.Pools() {
			pinned += p.Stats().Pinned
		}
		if pinned == 0 {
			return
		}
		if time.Now().After(deadline) {
			checkPoolsFree(t, e.Instance())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestEngineMatchesInstance: requests run concurrently through the
// executor give exactly the tokens of a lone run on the instance.
func TestEngineMatchesInstance(t *testing.T) {
	icfg := InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 1024}
	e := newTestEngine(t, "tiny-gqa", icfg, Options{})
	ref := newTestInstance(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
	const n = 8
	var streams []*Stream
	var prompts [][]int32
	for i := range n {
		p := prompt(fmt.Sprintf("request %d says hi", i))
		prompts = append(prompts, p)
		streams = append(streams, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 6 + i, IgnoreEOS: true}))
	}
	for i, s := range streams {
		res := waitResult(t, s)
		want := generate(t, ref, prompts[i], 6+i, 0, 0)
		if fmt.Sprint(res.Tokens) != fmt.Sprint(want.tokens) {
			t.Errorf("request %d: tokens %v, want %v", i, res.Tokens, want.tokens)
		}
		f := res.Final
		if f.FinishReason != FinishLength || f.Err != nil || f.State != transceiver.GenerationComplete {
			t.Errorf("request %d: finish %q err %v state %v", i, f.FinishReason, f.Err, f.State)
		}
		if f.Usage != (Usage{PromptTokens: len(prompts[i]), CompletionTokens: 6 + i}) {
			t.Errorf("request %d: usage %+v", i, f.Usage)
		}
		if res.Text != (Tokenizer{}).Decode(res.Tokens) {
			t.Errorf("request %d: text %q, tokens decode to %q", i, res.Text, Tokenizer{}.Decode(res.Tokens))
		}
		if f.Timing.Prefill <= 0 || f.Timing.FirstDecode <= 0 || f.Timing.Total < f.Timing.Prefill+f.Timing.Decode {
			t.Errorf("request %d: timing %+v", i, f.Timing)
		}
	}
	checkPoolsFree(t, e.Instance())
}

// TestStopConditions covers max_tokens, stop strings and stop tokens,
// streamed and collected.
func TestStopConditions(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 512}, Options{})
	p := prompt("Stop here.")
	full := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 24, IgnoreEOS: true}))
	if len(full.Tokens) != 24 || full.Final.FinishReason != FinishLength {
		t.Fatalf("reference: %d tokens, %q", len(full.Tokens), full.Final.FinishReason)
	}
	text := full.Text
	stop := text[10:12]
	cut := strings.Index(text, stop)
	stopTok := full.Tokens[7]
	tokCut := 0
	for full.Tokens[tokCut] != stopTok {
		tokCut++
	}
	tests := []struct {
		name       string
		req        Request
		wantReason string
		wantText   string
		wantTokens int
	}{
		{"max_tokens", Request{Prompt: p, MaxTokens: 5, IgnoreEOS: true}, FinishLength, Tokenizer{}.Decode(full.Tokens[:5]), 5},
		{"max_tokens 1", Request{Prompt: p, MaxTokens: 1, IgnoreEOS: true}, FinishLength, Tokenizer{}.Decode(full.Tokens[:1]), 1},
		{"stop string", Request{Prompt: p, MaxTokens: 24, IgnoreEOS: true, Stop: []string{"never appears \x00", stop}}, FinishStop, text[:cut], cut + len(stop)},
		{"stop token", Request{Prompt: p, MaxTokens: 24, IgnoreEOS: true, StopTokenIDs: []int32{stopTok}}, FinishStop, Tokenizer{}.Decode(full.Tokens[:tokCut+1]), tokCut + 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := submit(t, e, context.Background(), tc.req)
			var streamed strings.Builder
			var res Result
			for ev := range s.Events() {
				streamed.WriteString(ev.Text)
				if ev.Final != nil {
					res.Final = *ev.Final
				} else {
					res.Tokens = append(res.Tokens, ev.Token)
				}
			}
			if res.Final.FinishReason != tc.wantReason || res.Final.Err != nil {
				t.Errorf("finish %q (%v), want %q", res.Final.FinishReason, res.Final.Err, tc.wantReason)
			}
			if streamed.String() != tc.wantText {
				t.Errorf("text %q, want %q", streamed.String(), tc.wantText)
			}
			if len(res.Tokens) != tc.wantTokens || res.Final.Usage.CompletionTokens != tc.wantTokens {
				t.Errorf("%d tokens (usage %d), want %d", len(res.Tokens), res.Final.Usage.CompletionTokens, tc.wantTokens)
			}
		})
	}
	checkPoolsFree(t, e.Instance())
}

// TestCancel: a client's cancel ends the request in each phase and gives
// its blocks back.
func TestCancel(t *testing.T) {
	t.Run("mid-decode", func(t *testing.T) {
		e := newTestEngine(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 512}, Options{})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s := submit(t, e, ctx, Request{Prompt: prompt("cancel me"), MaxTokens: 400, IgnoreEOS: true})
		got := 0
		var final *Final
		for ev := range s.Events() {
			if ev.Final != nil {
				final = ev.Final
				break
			}
			if got++; got == 3 {
				if free := e.Instance().FreeBlocks(); free == e.Instance().NumBlocks() {
					t.Error("no blocks held while decoding")
				}
				cancel()
			}
		}
		if final == nil || final.FinishReason != FinishError || !errors.Is(final.Err, context.Canceled) {
			t.Fatalf("final %+v", final)
		}
		if final.Usage.CompletionTokens >= 400 {
			t.Errorf("%d tokens: the cancel did not stop the decode", final.Usage.CompletionTokens)
		}
		checkPoolsFree(t, e.Instance())
	})
	t.Run("queued", func(t *testing.T) {
		// The pool holds one request at a time: the second one queues.
		e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 64}, Options{})
		first := submit(t, e, context.Background(), Request{Prompt: prompt("first"), MaxTokens: 50, IgnoreEOS: true})
		ctx, cancel := context.WithCancel(context.Background())
		second := submit(t, e, ctx, Request{Prompt: prompt("second"), MaxTokens: 50, IgnoreEOS: true})
		cancel()
		res := waitResult(t, second)
		if !errors.Is(res.Final.Err, context.Canceled) || len(res.Tokens) != 0 {
			t.Errorf("queued request: %d tokens, %+v", len(res.Tokens), res.Final)
		}
		if r := waitResult(t, first); r.Final.FinishReason != FinishLength {
			t.Errorf("first request: %+v", r.Final)
		}
		checkPoolsFree(t, e.Instance())
	})
	t.Run("before submit", func(t *testing.T) {
		e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 64}, Options{})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := e.Submit(ctx, Request{Prompt: prompt("x")}); !errors.Is(err, context.Canceled) {
			t.Errorf("Submit with a cancelled context: %v", err)
		}
	})
}

// TestQueueForBlocks: more requests than the pool holds at once wait for
// blocks and all complete with the right tokens.
func TestQueueForBlocks(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa2", InstanceConfig{TP: 4, TokensPerBlock: 8, PoolTokens: 64}, Options{})
	ref := newTestInstance(t, "tiny-gqa2", InstanceConfig{TokensPerBlock: 8, PoolTokens: 64})
	var streams []*Stream
	for i := range 6 {
		streams = append(streams, submit(t, e, context.Background(), Request{Prompt: prompt(fmt.Sprint("queue ", i)), MaxTokens: 20, IgnoreEOS: true}))
	}
	for i, s := range streams {
		res := waitResult(t, s)
		want := generate(t, ref, prompt(fmt.Sprint("queue ", i)), 20, 0, 0)
		if fmt.Sprint(res.Tokens) != fmt.Sprint(want.tokens) {
			t.Errorf("request %d: %v, want %v (%v)", i, res.Tokens, want.tokens, res.Final.Err)
		}
	}
	checkPoolsFree(t, e.Instance())
}

func TestSubmitErrors(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 64}, Options{})
	long := make([]int32, 100)
	tests := []struct {
		name string
		req  Request
		want error
		msg  string
	}{
		{"empty prompt", Request{}, ErrBadRequest, "empty prompt"},
		{"token out of vocabulary", Request{Prompt: []int32{BOS, 300}}, ErrBadRequest, "out of the vocabulary"},
		{"negative max_tokens", Request{Prompt: prompt("x"), MaxTokens: -1}, ErrBadRequest, "max_tokens"},
		{"NaN temperature", Request{Prompt: prompt("x"), Sampling: Sampling{Temperature: math.NaN()}}, ErrBadRequest, "temperature"},
		{"prompt longer than the pool", Request{Prompt: long}, ErrBadRequest, "needs 15 blocks per rank, the pool of each rank has 8 (64 tokens)"},
		{"prompt and max_tokens longer than the pool", Request{Prompt: prompt("x"), MaxTokens: 100}, ErrBadRequest, "does not fit"},
		{"context_only without transceiver", Request{Type: transceiver.ContextOnly, Prompt: prompt("x")}, transceiver.ErrNoTransceiver, "need a cache transceiver"},
		{"generation_only without transceiver", Request{Type: transceiver.GenerationOnly, Prompt: prompt("x")}, transceiver.ErrNoTransceiver, "generation_only"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.Submit(context.Background(), tc.req)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("err %v, want %v containing %q", err, tc.want, tc.msg)
			}
		})
	}
	var tl *TooLongError
	if _, err := e.Submit(context.Background(), Request{Prompt: long}); !errors.As(err, &tl) || tl.NeedBlocks != 15 {
		t.Errorf("TooLongError: %v", err)
	}
}

// TestCloseEndsRequests: Close ends every request in the engine and
// leaves no block pinned.
func TestCloseEndsRequests(t *testing.T) {
	in, err := NewInstance(testModel(t, "tiny-gqa"), InstanceConfig{TokensPerBlock: 8, PoolTokens: 128})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(in, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var streams []*Stream
	for i := range 4 {
		streams = append(streams, submit(t, e, context.Background(), Request{Prompt: prompt(fmt.Sprint("close ", i)), MaxTokens: 50, IgnoreEOS: true}))
	}
	for range streams[0].Events() {
		break // running
	}
	if err := e.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for i, s := range streams {
		if res := s.Wait(); !errors.Is(res.Final.Err, ErrClosed) && res.Final.FinishReason != FinishLength {
			t.Errorf("request %d: %+v", i, res.Final)
		}
	}
	if _, err := e.Submit(context.Background(), Request{Prompt: prompt("late")}); !errors.Is(err, ErrClosed) {
		t.Errorf("Submit after Close: %v", err)
	}
	if err := e.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestConcurrentSubmit: many goroutines submit and cancel at once.
func TestConcurrentSubmit(t *testing.T) {
	e := newTestEngine(t, "tiny-mla", InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 256}, Options{MaxBatch: 4})
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s, err := e.Submit(ctx, Request{Prompt: prompt(fmt.Sprint("c", i)), MaxTokens: 4 + i%3, IgnoreEOS: true})
			if err != nil {
				t.Error(err)
				return
			}
			if i%3 == 0 {
				cancel()
			}
			res := s.Wait()
			want := 4 + i%3
			switch {
			case i%3 != 0:
				if res.Final.FinishReason != FinishLength || len(res.Tokens) != want {
					t.Errorf("request %d: %+v (%d tokens, want %d)", i, res.Final, len(res.Tokens), want)
				}
			case res.Final.FinishReason == FinishError:
				if !errors.Is(res.Final.Err, context.Canceled) {
					t.Errorf("cancelled request %d: %v, want context.Canceled", i, res.Final.Err)
				}
			case res.Final.FinishReason != FinishLength || len(res.Tokens) != want: // it finished before the cancel
				t.Errorf("cancelled request %d: %+v (%d tokens, want %d)", i, res.Final, len(res.Tokens), want)
			}
		})
	}
	wg.Wait()
	checkPoolsFree(t, e.Instance())
	// Every request has ended: nothing may be left waiting, running or
	// transferring, and every block is free (the stats may trail the
	// results by one scheduler step).
	deadline := time.Now().Add(2 * time.Second)
	for {
		st := e.Stats()
		if st.Waiting+st.Running+st.Transferring == 0 && st.FreeBlocks == st.TotalBlocks {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("stats after every request ended: %+v", st)
		}
		time.Sleep(time.Millisecond)
	}
}
