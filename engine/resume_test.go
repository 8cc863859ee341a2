package engine

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver"
)

// collect reads a stream to its end, keeping each token's text piece.
func collect(t testing.TB, s *Stream) (tokens []int32, pieces []string, final Final) {
	t.Helper()
	res := make(chan struct{})
	go func() {
		defer close(res)
		for ev := range s.Events() {
			if ev.Final != nil {
				final = *ev.Final
				pieces = append(pieces, ev.Text) // the flush: after the last token
				continue
			}
			tokens = append(tokens, ev.Token)
			pieces = append(pieces, ev.Text)
		}
	}()
	<-res
	return tokens, pieces, final
}

// TestResume: a request resumed after the first k tokens of an
// uninterrupted run (the router migrating it off a dead instance) gives
// exactly the rest: the same tokens, the text the uninterrupted run emits
// after its k-th token (held-back text included), the same finish reason,
// and usage counting every generated token. For every cut point, greedy
// and seeded, with a stop string and with EOS, aggregated on several
// layouts and disaggregated (context_only resumed on one layout,
// generation_only on another).
func TestResume(t *testing.T) {
	agg := map[string]*Engine{}
	for name, cfg := range map[string]InstanceConfig{"TP1": {}, "TP2": {TP: 2}, "PP2": {PP: 2}, "TP2 PP2": {TP: 2, PP: 2}} {
		cfg.TokensPerBlock, cfg.PoolTokens = 8, 1024
		var opts Options
		if name == "TP2 PP2" {
			// With block reuse: a resumed request finds the blocks the
			// uninterrupted run filled, its generated tokens' included.
			opts = reuseOpts
		}
		agg[name] = newTestEngine(t, "tiny-gqa", cfg, opts)
	}
	prefillE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: 8, DType: kvcache.BF16, PoolTokens: 2048})
	genE := newDisaggEngine(t, "tiny-gqa", InstanceConfig{PP: 2, TokensPerBlock: 8, DType: kvcache.BF16, PoolTokens: 2048})
	seed := uint64(11)
	const n = 14
	reusedTokens := 0 // prompt tokens the engine with block reuse found cached
	defer func() {
		if reusedTokens == 0 && !t.Failed() {
			t.Error("the engine with block reuse never reused a prompt token")
		}
	}()
	base := []Request{
		{Prompt: prompt("Resume greedy"), MaxTokens: n, IgnoreEOS: true},
		{Prompt: prompt("Resume seeded"), MaxTokens: n, IgnoreEOS: true, Sampling: Sampling{Temperature: 1.2, Seed: &seed}},
		{Prompt: prompt("Resume hot"), MaxTokens: n, Sampling: Sampling{Temperature: 2, Seed: &seed}}, // may meet EOS
	}
	var reqs []Request
	for _, req := range base {
		reqs = append(reqs, req)
		// The same with a stop string from the middle of its text: the
		// text is held back while it may start one.
		full := waitResult(t, submit(t, agg["TP1"], context.Background(), req))
		if len(full.Text) >= 8 {
			st := req
			st.Stop = []string{full.Text[len(full.Text)-4 : len(full.Text)-1]}
			reqs = append(reqs, st)
		}
	}
	for i, req := range reqs {
		ref := agg["TP1"]
		want, pieces, wf := collect(t, submit(t, ref, context.Background(), req))
		wantText := ""
		for _, p := range pieces {
			wantText += p
		}
		if len(want) == 0 {
			t.Fatalf("request %d: no tokens", i)
		}
		t.Logf("request %d (stop %q): %d tokens, %q, %s", i, req.Stop, len(want), wantText, wf.FinishReason)
		for k := range len(want) {
			if k > 0 && (want[k-1] == EOS && !req.IgnoreEOS) {
				break
			}
			sent := ""
			for _, p := range pieces[:k] {
				sent += p
			}
			check := func(layout string, tokens []int32, text string, f Final) {
				t.Helper()
				if !slices.Equal(tokens, want[k:]) || sent+text != wantText || f.FinishReason != wf.FinishReason || f.Err != nil {
					t.Fatalf("request %d (stop %q) resumed after %d tokens on %s: tokens %v text %q finish %q (%v); want %v, %q (after %q), %q",
						i, req.Stop, k, layout, tokens, text, f.FinishReason, f.Err, want[k:], wantText[len(sent):], sent, wf.FinishReason)
				}
				u := f.Usage
				if layout == "TP2 PP2" {
					// Block reuse: the earlier runs cached some of it.
					if u.CachedTokens > len(req.Prompt) {
						t.Fatalf("request %d resumed after %d with block reuse: %d of %d prompt tokens cached", i, k, u.CachedTokens, len(req.Prompt))
					}
					reusedTokens += u.CachedTokens
					u.CachedTokens = 0
				}
				if u != wf.Usage || !slices.Equal(f.PromptTokenIDs, req.Prompt) {
					t.Fatalf("request %d resumed after %d on %s: usage %+v prompt %v, want %+v %v", i, k, layout, f.Usage, f.PromptTokenIDs, wf.Usage, req.Prompt)
				}
			}
			rreq := req
			rreq.Resume = want[:k]
			for name, e := range agg {
				tokens, pieces, f := collect(t, submit(t, e, context.Background(), rreq))
				check(name, tokens, join(pieces), f)
			}
			// Disaggregated: the context phase samples token k, the
			// generation phase pulls the KV of the prompt and the k tokens.
			creq := rreq
			creq.Type = transceiver.ContextOnly
			ctok, cpieces, cf := collect(t, submit(t, prefillE, context.Background(), creq))
			if cf.FinishReason == FinishStop {
				check("context_only", ctok, join(cpieces), cf)
				continue
			}
			if cf.Err != nil || cf.ContextPhase == nil || len(ctok) != 1 || ctok[0] != want[k] {
				t.Fatalf("request %d resumed after %d: context_only %v %q %v, want token %d", i, k, ctok, cf.FinishReason, cf.Err, want[k])
			}
			greq := rreq
			greq.Type, greq.Prompt, greq.ContextPhase = transceiver.GenerationOnly, cf.PromptTokenIDs, cf.ContextPhase
			tokens, gpieces, f := collect(t, submit(t, genE, context.Background(), greq))
			check("generation_only", tokens, join(gpieces), f)
		}
	}
	waitPoolsFree(t, prefillE)
	waitPoolsFree(t, genE)
}

func join(ss []string) string {
	out := ""
	for _, s := range ss {
		out += s
	}
	return out
}

// TestResumeRefused: resumed tokens that leave nothing to generate, that
// ended the request, or that are not tokens are refused at Submit.
func TestResumeRefused(t *testing.T) {
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 512}, Options{})
	p := prompt("refused")
	for _, c := range []struct {
		name string
		req  Request
	}{
		{"as many as max_tokens", Request{Prompt: p, MaxTokens: 2, Resume: []int32{'a', 'b'}}},
		{"EOS", Request{Prompt: p, MaxTokens: 4, Resume: []int32{'a', EOS}}},
		{"stop token", Request{Prompt: p, MaxTokens: 4, StopTokenIDs: []int32{'b'}, Resume: []int32{'a', 'b'}}},
		{"stop string", Request{Prompt: p, MaxTokens: 4, Stop: []string{"ab"}, Resume: []int32{'a', 'b'}}},
		{"out of the vocabulary", Request{Prompt: p, MaxTokens: 4, Resume: []int32{VocabSize}}},
		{"negative", Request{Prompt: p, MaxTokens: 4, Resume: []int32{-1}}},
	} {
		if _, err := e.Submit(context.Background(), c.req); !errors.Is(err, ErrBadRequest) {
			t.Errorf("%s: %v, want ErrBadRequest", c.name, err)
		}
	}
	// EOS is a token like any other with ignore_eos.
	res := waitResult(t, submit(t, e, context.Background(), Request{Prompt: p, MaxTokens: 3, IgnoreEOS: true, Resume: []int32{EOS}}))
	if res.Final.Err != nil || len(res.Tokens) != 2 || res.Final.Usage.CompletionTokens != 3 {
		t.Errorf("resumed after EOS with ignore_eos: %v %+v", res.Tokens, res.Final)
	}
}
