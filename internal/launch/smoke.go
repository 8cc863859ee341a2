package launch

import (
	"context"
	"fmt"
	"net/http"
	"slices"
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

// Smoke sends n prompts, streamed, through the router and to the aggregated
// worker with the same seed and compares the answers; concurrency prompts
// run at a time.
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
			body := map[string]any{"prompt": prompt, "max_tokens": 24, "temperature": 0, "seed": i, "stream": true}
			if i%3 == 1 {
				body["temperature"] = 0.8 // seeded sampling must match too
			}
			dText, dTTFT, derr := serve.StreamCompletion(ctx, client, routerURL, body)
			aText, aTTFT, aerr := serve.StreamCompletion(ctx, client, aggregatedURL, body)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case derr != nil:
				res.Failures = append(res.Failures, fmt.Sprintf("prompt %d via the router: %v", i, derr))
			case aerr != nil:
				res.Failures = append(res.Failures, fmt.Sprintf("prompt %d on the aggregated worker: %v", i, aerr))
			case dText != aText:
				res.Failures = append(res.Failures, fmt.Sprintf("prompt %d: disaggregated %q != aggregated %q", i, dText, aText))
			default:
				res.Matched++
				res.TTFTDisagg = append(res.TTFTDisagg, dTTFT)
				res.TTFTAgg = append(res.TTFTAgg, aTTFT)
			}
		}()
	}
	wg.Wait()
	return res
}
