package launch

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/serve"
)

// SmokeResult is the outcome of Smoke.
type SmokeResult struct {
	Prompts    int
	Matched    int
	Failures   []string
	TTFTDisagg []time.Duration // through the router (disaggregated)
	TTFTAgg    []time.Duration // the aggregated worker
}

// OK reports whether every answer matched.
func (s *SmokeResult) OK() bool {
	return s.Prompts > 0 && s.Matched == s.Prompts && len(s.Failures) == 0
}

// Percentile returns the p-th percentile of ds.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

// SmokePrompts are the prompts of Smoke, cycled.
var SmokePrompts = []string{
	"The quick brown fox", "KV caches move from prefill to decode.", "Once upon a time",
	"Disaggregated serving splits", "0123456789", "Hello, world!", "Tensor parallel ranks",
	"A long prompt that spans several blocks of the paged KV cache, so that the transfer moves more than one block per rank and the chunking is exercised.",
}

// smokeMaxTokens is the length of every smoke answer: the requests ask
// for ignore_eos, so each answer is exactly this many tokens.
const smokeMaxTokens = 24

// Smoke sends n prompts, streamed and not, through the router and to the
// aggregated worker with the same seed and compares the answers;
// concurrency prompts run at a time. The requests ask for ignore_eos and
// return_token_ids: every answer must carry smokeMaxTokens token ids (and
// count as many in its usage), end by length and have text, and the four
// answers to a prompt must have the same token ids and the same text.
func Smoke(ctx context.Context, routerURL, aggregatedURL string, n, concurrency int) *SmokeResult {
	return SmokeWith(ctx, nil, routerURL, aggregatedURL, n, concurrency)
}

// SmokeWith is Smoke with the transport of base (nil: the default), such as
// Launched.Client's for an aggregated worker that requires mutual TLS.
func SmokeWith(ctx context.Context, base *http.Client, routerURL, aggregatedURL string, n, concurrency int) *SmokeResult {
	res := &SmokeResult{Prompts: n}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(1, concurrency))
	client := &http.Client{Timeout: 2 * time.Minute}
	if base != nil {
		client.Transport = base.Transport
	}
	defer client.CloseIdleConnections()
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			prompt := SmokePrompts[i%len(SmokePrompts)]
			body := map[string]any{"prompt": prompt, "max_tokens": smokeMaxTokens, "temperature": 0, "seed": i, "stream": true,
				"ignore_eos": true, "return_token_ids": true, "stream_options": map[string]any{"include_usage": true}}
			if i%3 == 1 {
				body["temperature"] = 0.8 // seeded sampling must match too
			}
			d, derr := streamAnswer(ctx, client, routerURL, body)
			a, aerr := streamAnswer(ctx, client, aggregatedURL, body)
			plain := maps.Clone(body)
			plain["stream"] = false
			delete(plain, "stream_options")
			dp, dperr := plainAnswer(ctx, client, routerURL, plain)
			ap, aperr := plainAnswer(ctx, client, aggregatedURL, plain)
			mu.Lock()
			defer mu.Unlock()
			fail := func(format string, args ...any) {
				res.Failures = append(res.Failures, fmt.Sprintf("prompt %d: ", i)+fmt.Sprintf(format, args...))
			}
			switch {
			case derr != nil:
				fail("via the router: %v", derr)
			case aerr != nil:
				fail("on the aggregated worker: %v", aerr)
			case dperr != nil:
				fail("via the router, not streamed: %v", dperr)
			case aperr != nil:
				fail("on the aggregated worker, not streamed: %v", aperr)
			case d.check() != "":
				fail("via the router: %s", d.check())
			case a.check() != "":
				fail("on the aggregated worker: %s", a.check())
			case dp.check() != "":
				fail("via the router, not streamed: %s", dp.check())
			case ap.check() != "":
				fail("on the aggregated worker, not streamed: %s", ap.check())
			case !slices.Equal(d.ids, a.ids):
				fail("disaggregated token ids %v != aggregated %v", d.ids, a.ids)
			case !slices.Equal(dp.ids, a.ids) || !slices.Equal(ap.ids, a.ids):
				fail("not streamed, token ids %v via the router and %v aggregated != streamed %v", dp.ids, ap.ids, a.ids)
			case d.text != a.text || dp.text != a.text || ap.text != a.text:
				fail("texts differ: disaggregated %q (not streamed %q), aggregated %q (not streamed %q)", d.text, dp.text, a.text, ap.text)
			default:
				res.Matched++
				res.TTFTDisagg = append(res.TTFTDisagg, d.ttft)
				res.TTFTAgg = append(res.TTFTAgg, a.ttft)
			}
		}()
	}
	wg.Wait()
	return res
}

// answer is what Smoke reads of a completion, streamed or not.
type answer struct {
	text   string
	ids    []int32 // the generated token ids (return_token_ids)
	finish string  // the finish_reason of the last chunk
	tokens int     // usage.completion_tokens
	ttft   time.Duration
}

// check returns what is wrong with an answer to a Smoke request, or "".
func (a *answer) check() string {
	switch {
	case len(a.ids) != smokeMaxTokens:
		return fmt.Sprintf("%d token ids, want %d (ignore_eos)", len(a.ids), smokeMaxTokens)
	case a.tokens != smokeMaxTokens:
		return fmt.Sprintf("%d completion tokens, want %d (ignore_eos)", a.tokens, smokeMaxTokens)
	case a.finish != "length":
		return fmt.Sprintf("finish_reason %q, want \"length\"", a.finish)
	case a.text == "":
		return fmt.Sprintf("%d tokens but no text", a.tokens)
	}
	return ""
}

// streamAnswer posts body, a streaming completion request, to the
// /v1/completions of base and reads the stream (serve.StreamCompletion: an
// answer other than 200, an error event, an event that does not decode and
// a stream that ends without [DONE] are errors).
func streamAnswer(ctx context.Context, c *http.Client, base string, body map[string]any) (*answer, error) {
	r, err := serve.StreamCompletion(ctx, c, base, body)
	if err != nil {
		return nil, err
	}
	return &answer{text: r.Text, ids: r.TokenIDs, finish: r.FinishReason, tokens: r.CompletionTokens, ttft: r.TTFT}, nil
}

// plainAnswer posts body, a completion request that does not stream, to
// the /v1/completions of base and reads the answer: one other than 200, or
// without one choice, is an error.
func plainAnswer(ctx context.Context, c *http.Client, base string, body map[string]any) (*answer, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(raw)))
	}
	var v struct {
		Choices []struct {
			Text         string  `json:"text"`
			TokenIDs     []int32 `json:"token_ids"`
			FinishReason string  `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &v); err != nil || len(v.Choices) != 1 {
		return nil, fmt.Errorf("answer %q: want one choice (%v)", raw, err)
	}
	ch := v.Choices[0]
	return &answer{text: ch.Text, ids: ch.TokenIDs, finish: ch.FinishReason, tokens: v.Usage.CompletionTokens}, nil
}
