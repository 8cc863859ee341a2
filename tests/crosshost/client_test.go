package crosshost

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// outcome of one request.
type outcome int

const (
	okExact  outcome = iota // 200, [DONE] (streamed), the aggregated worker's token ids
	clearErr                // a non-200 answer with a JSON error, or a stream error event without [DONE]
	bad                     // anything else: wrong tokens, a stream cut without a word, a missed deadline
)

func (o outcome) String() string { return [...]string{"bit-exact", "clear error", "BAD"}[o] }

const maxTokens = 16

func prompt(i int) string {
	return fmt.Sprintf("request %d across hosts: the quick brown fox jumps over the lazy dog %d times, then %s", i, i*7, strings.Repeat("again and ", 4+i%5))
}

// answer sends prompt i to base (greedy, ignore_eos, fixed max_tokens,
// return_token_ids) and returns the generated token ids, or why not.
// Its outcome is okExact only if the answer is complete; the caller
// compares the ids.
func answer(ctx context.Context, c *http.Client, base string, i int, stream bool) ([]int32, outcome, string) {
	body, _ := json.Marshal(map[string]any{"prompt": prompt(i), "max_tokens": maxTokens, "temperature": 0, "ignore_eos": true,
		"return_token_ids": true, "stream": stream})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, bad, "no answer: " + err.Error()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		var e struct {
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(b, &e) == nil && e.Error != nil && e.Error.Message != "" {
			return nil, clearErr, fmt.Sprintf("%d %s", resp.StatusCode, e.Error.Message)
		}
		return nil, bad, fmt.Sprintf("%d without a JSON error: %q", resp.StatusCode, b)
	}
	type choice struct {
		TokenIDs []int32 `json:"token_ids"`
	}
	type event struct {
		Choices []choice `json:"choices"`
		Error   *struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if !stream {
		var ev event
		if err := json.NewDecoder(resp.Body).Decode(&ev); err != nil || len(ev.Choices) != 1 {
			return nil, bad, fmt.Sprintf("200 with an unreadable body: %v", err)
		}
		return ev.Choices[0].TokenIDs, okExact, ""
	}
	var ids []int32
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	errEvent := ""
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			if errEvent != "" {
				return nil, bad, "[DONE] after an error event: " + errEvent
			}
			return ids, okExact, ""
		}
		var ev event
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return nil, bad, fmt.Sprintf("bad event %q", data)
		}
		if ev.Error != nil {
			errEvent = ev.Error.Message
			continue
		}
		for _, ch := range ev.Choices {
			ids = append(ids, ch.TokenIDs...)
		}
	}
	if errEvent != "" {
		return nil, clearErr, "stream error event: " + errEvent
	}
	return nil, bad, fmt.Sprintf("stream ended without [DONE] or an error event (%v)", sc.Err())
}

// tally counts outcomes.
type tally struct {
	n    [3]int
	errs []string
}

func (t *tally) String() string {
	return fmt.Sprintf("%d requests: %d bit-exact, %d clear errors, %d bad", t.n[0]+t.n[1]+t.n[2], t.n[okExact], t.n[clearErr], t.n[bad])
}

// burst sends n requests (half streamed), conc at a time, through base,
// each within deadline, and compares the ids with want(i).
func burst(t *testing.T, c *http.Client, base string, first, n, conc int, deadline time.Duration, want func(int) []int32) *tally {
	t.Helper()
	var tl tally
	type res struct {
		o   outcome
		msg string
	}
	out := make(chan res, n)
	sem := make(chan struct{}, conc)
	for i := first; i < first+n; i++ {
		sem <- struct{}{}
		go func() {
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(t.Context(), deadline)
			defer cancel()
			start := time.Now()
			ids, o, msg := answer(ctx, c, base, i, i%2 == 0)
			if o == okExact && !slices.Equal(ids, want(i)) {
				o, msg = bad, fmt.Sprintf("token ids %v, the aggregated worker's %v", ids, want(i))
			}
			if o != okExact {
				msg = fmt.Sprintf("request %d (stream=%v) after %v: %s", i, i%2 == 0, time.Since(start).Round(time.Millisecond), msg)
			}
			out <- res{o, msg}
		}()
	}
	for range n {
		r := <-out
		tl.n[r.o]++
		if r.msg != "" {
			tl.errs = append(tl.errs, r.msg)
		}
	}
	return &tl
}

// metric sums the samples of name whose labels contain every one of
// labels (`backend="tcp"`).
func metric(c *http.Client, url, name string, labels ...string) (float64, error) {
	resp, err := c.Get(url + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for l := range strings.SplitSeq(string(b), "\n") {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		lbl := l[:max(strings.LastIndexByte(l, ' '), 0)] // label values may hold spaces ("POST /v1/completions")
		if !slices.ContainsFunc(labels, func(x string) bool { return !strings.Contains(lbl, x) }) {
			var v float64
			fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
			sum += v
		}
	}
	return sum, nil
}

// clusterInfo is what the tests read of the router's /cluster_info.
type clusterInfo struct {
	IsReady        bool `json:"is_ready"`
	CurrentWorkers map[string][]struct {
		URL        string `json:"url"`
		MarkedDown bool   `json:"marked_down"`
	} `json:"current_workers"`
}

func members(c *http.Client, router string) clusterInfo {
	var ci clusterInfo
	resp, err := c.Get(router + "/cluster_info")
	if err != nil {
		return ci
	}
	defer resp.Body.Close()
	json.NewDecoder(resp.Body).Decode(&ci)
	return ci
}

// waitMembers waits until the router routes to exactly the urls given per
// role (none marked down).
func waitMembers(t *testing.T, c *http.Client, router string, limit time.Duration, ctxURLs, genURLs []string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		ci := members(c, router)
		same := func(role string, want []string) bool {
			var got []string
			for _, w := range ci.CurrentWorkers[role] {
				if !w.MarkedDown {
					got = append(got, w.URL)
				}
			}
			slices.Sort(got)
			w := slices.Sorted(slices.Values(want))
			return slices.Equal(got, w)
		}
		if same("context_servers", ctxURLs) && same("generation_servers", genURLs) {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			t.Fatalf("members %+v: want context %v and generation %v within %v", ci.CurrentWorkers, ctxURLs, genURLs, limit)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// noPinned waits until no block of url's pools is pinned by a request.
func noPinned(t *testing.T, c *http.Client, name, url string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		pinned, err := metric(c, url, "kvxfer_pool_blocks", `state="pinned"`)
		free, _ := metric(c, url, "kvxfer_pool_blocks", `state="free"`)
		if err == nil && pinned == 0 && free > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: %v blocks still pinned (%v free) 15 s after the last request: leaked (%v)", name, pinned, free, err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// bytesByBackend is kvxfer_transfer_bytes_total at url by its backend
// label ("tcp", "shm", "ucx(tcp)": UCX names the UCX transports it used).
func bytesByBackend(c *http.Client, url string) map[string]float64 {
	resp, err := c.Get(url + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := map[string]float64{}
	for l := range strings.SplitSeq(string(b), "\n") {
		rest, ok := strings.CutPrefix(l, `kvxfer_transfer_bytes_total{backend="`)
		if !ok {
			continue
		}
		be, _, _ := strings.Cut(rest, `"`)
		var v float64
		fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
		m[be] += v
	}
	return m
}

// metricLines returns the samples of name at url, for messages.
func metricLines(c *http.Client, url, name string) string {
	resp, err := c.Get(url + "/metrics")
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out []string
	for l := range strings.SplitSeq(string(b), "\n") {
		if strings.HasPrefix(l, name) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}
