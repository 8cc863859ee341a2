package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// reqSpec is one completion request of the load: greedy or seeded,
// streamed or not, always with return_token_ids and ignore_eos, so its
// token ids are fixed by the prompt, the sampling and max_tokens.
type reqSpec struct {
	id        int
	prompt    string
	maxTokens int
	seed      uint64  // with temperature > 0
	temp      float64 // 0: greedy
	stream    bool
}

func (r reqSpec) body() map[string]any {
	b := map[string]any{"model": "tiny-gqa", "prompt": r.prompt, "max_tokens": r.maxTokens, "stream": r.stream,
		"return_token_ids": true, "ignore_eos": true, "temperature": r.temp}
	if r.temp > 0 {
		b["seed"] = r.seed
	}
	return b
}

// key identifies what fixes the answer (not stream).
func (r reqSpec) key() string {
	return fmt.Sprintf("%d|%g|%d|%s", r.maxTokens, r.temp, r.seed, r.prompt)
}

var words = strings.Fields("the a of kv cache block moves between ranks while decode waits for prefill on another host " +
	"token layer head shard tensor pipeline router worker stream frame byte deadline error retry context generation " +
	"alpha beta gamma delta seven eleven blue green quiet loud river stone")

// makeSpecs returns n distinct request specs from r.
func makeSpecs(r *rng, n, maxTokens int) []reqSpec {
	out := make([]reqSpec, n)
	for i := range out {
		nw := 4 + r.intn(40)
		ws := make([]string, nw)
		for j := range ws {
			ws[j] = words[r.intn(len(words))]
		}
		s := reqSpec{id: i, prompt: strings.Join(ws, " "), maxTokens: maxTokens, stream: r.intn(2) == 0}
		if r.intn(2) == 0 {
			s.temp, s.seed = 0.8, r.next()%1000000
		}
		out[i] = s
	}
	return out
}

// class is how a request ended.
type class int

const (
	classOK     class = iota // completed, token ids equal the reference
	classFailed              // failed with a clear error
	classWrong               // completed with other tokens, cut silently, or an unclear error
)

type outcome struct {
	spec       reqSpec
	class      class
	start, end time.Time
	msg        string
	firstChunk time.Time // streamed: when the first token arrived
}

// result is what one request returned: ids when it completed, else a
// clear error (clear true) or an unclear one.
type result struct {
	ids        []int32
	err        error
	clear      bool
	firstChunk time.Time
}

type apiError struct {
	Error *struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// complete posts spec to base's /v1/completions and reads the answer.
// onChunk, when set, is called for each stream event that carries tokens,
// with whether it is the first.
func complete(ctx context.Context, hc *http.Client, base string, spec reqSpec, onChunk func(first bool)) result {
	b, _ := json.Marshal(spec.body())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return result{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		return result{err: fmt.Errorf("no answer: %w", err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		var e apiError
		if json.Unmarshal(body, &e) == nil && e.Error != nil && e.Error.Message != "" {
			return result{err: fmt.Errorf("%s: %s: %s", resp.Status, e.Error.Type, e.Error.Message), clear: true}
		}
		return result{err: fmt.Errorf("%s without an OpenAI error: %q", resp.Status, body)}
	}
	if !spec.stream {
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return result{err: fmt.Errorf("200, then the body broke: %w", err)}
		}
		var out struct {
			Choices []struct {
				TokenIDs     []int32 `json:"token_ids"`
				FinishReason string  `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(body, &out); err != nil || len(out.Choices) != 1 {
			return result{err: fmt.Errorf("200 with a body that does not decode (%v): %.200q", err, body)}
		}
		return result{ids: out.Choices[0].TokenIDs}
	}
	var r result
	ids := []int32{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			r.ids = ids
			return r
		}
		var ch struct {
			Choices []struct {
				TokenIDs []int32 `json:"token_ids"`
			} `json:"choices"`
			apiError
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return result{err: fmt.Errorf("stream event that does not decode (%v): %.200q", err, data)}
		}
		if ch.Error != nil {
			if ch.Error.Message == "" {
				return result{err: fmt.Errorf("error event without a message: %.200q", data)}
			}
			return result{err: fmt.Errorf("error event: %s: %s", ch.Error.Type, ch.Error.Message), clear: true, firstChunk: r.firstChunk}
		}
		for _, c := range ch.Choices {
			if len(c.TokenIDs) == 0 {
				continue
			}
			first := r.firstChunk.IsZero()
			if first {
				r.firstChunk = time.Now()
			}
			if onChunk != nil {
				onChunk(first)
			}
			ids = append(ids, c.TokenIDs...)
		}
	}
	return result{err: fmt.Errorf("stream ended without [DONE] or an error event (cut silently): %v", sc.Err()), firstChunk: r.firstChunk}
}

// classify compares res with the reference ids.
func classify(res result, ref []int32) (class, string) {
	switch {
	case res.err == nil && slices.Equal(res.ids, ref):
		return classOK, ""
	case res.err == nil:
		return classWrong, fmt.Sprintf("completed with other tokens: %v, want %v", res.ids, ref)
	case res.clear:
		return classFailed, res.err.Error()
	}
	return classWrong, res.err.Error()
}

// references computes the answers of specs on the aggregated worker at
// base, once per distinct key.
func references(hc *http.Client, base string, specs []reqSpec) (map[string][]int32, error) {
	refs := map[string][]int32{}
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	sem := make(chan struct{}, 2)
	seen := map[string]bool{}
	for _, s := range specs {
		if seen[s.key()] {
			continue
		}
		seen[s.key()] = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			s.stream = false
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			r := complete(ctx, hc, base, s, nil)
			mu.Lock()
			defer mu.Unlock()
			if r.err != nil || len(r.ids) != s.maxTokens {
				if firstErr == nil {
					firstErr = fmt.Errorf("reference of %d: %v (%d ids)", s.id, r.err, len(r.ids))
				}
				return
			}
			refs[s.key()] = r.ids
		}()
	}
	wg.Wait()
	return refs, firstErr
}

// drive runs specs through base at concurrency c and returns every
// outcome; each request is bounded by perReq.
func drive(hc *http.Client, base string, specs []reqSpec, refs map[string][]int32, c int, perReq time.Duration) []outcome {
	return driveUntil(hc, base, specs, refs, c, perReq, nil)
}

// driveUntil is drive that, once every spec has been sent, goes on sending
// them again, in the same order, until stop is closed (nil: it is not
// waited for), at most maxRounds times over: the requests of a faulty run
// must still be under way when its last fault comes. The outcomes are
// those of every request sent.
func driveUntil(hc *http.Client, base string, specs []reqSpec, refs map[string][]int32, c int, perReq time.Duration, stop <-chan struct{}) []outcome {
	const maxRounds = 50
	var (
		mu  sync.Mutex
		out []outcome
	)
	next := make(chan reqSpec)
	var wg sync.WaitGroup
	for range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for spec := range next {
				ctx, cancel := context.WithTimeout(context.Background(), perReq)
				start := time.Now()
				r := complete(ctx, hc, base, spec, nil)
				cancel()
				if errors.Is(r.err, context.DeadlineExceeded) {
					r.err, r.clear = fmt.Errorf("no end within %v (hung): %w", perReq, r.err), false
				}
				cl, msg := classify(r, refs[spec.key()])
				mu.Lock()
				out = append(out, outcome{spec: spec, class: cl, start: start, end: time.Now(), msg: msg, firstChunk: r.firstChunk})
				mu.Unlock()
			}
		}()
	}
	stopped := func() bool {
		if stop == nil {
			return true
		}
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	for round := 0; round == 0 || (round < maxRounds && !stopped()); round++ {
		for _, spec := range specs {
			next <- spec
		}
	}
	close(next)
	wg.Wait()
	return out
}
