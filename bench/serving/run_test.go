package serving

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeServer is an OpenAI-compatible /v1/completions that streams
// max_tokens tokens, one chunk each, a token every gap, the usage with
// kvxfer_timing, and [DONE]. fail, when set, picks requests to fail and
// how.
type fakeServer struct {
	gap  time.Duration
	fail func(prompt []int32) string // "", "400", "500", "event", "cut"
	// enter and leave, when set, are called as a request comes in and
	// just before its last write.
	enter, leave func()

	mu       sync.Mutex
	inflight int
	maxIn    int
	prompts  [][]int32
}

// answerOf is the fake's answer to a prompt: n tokens that depend on it.
func answerOf(prompt []int32, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32('a' + (len(prompt)+i)%26)
	}
	return out
}

func (f *fakeServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt         []int32 `json:"prompt"`
		MaxTokens      int     `json:"max_tokens"`
		Stream         bool    `json:"stream"`
		IgnoreEOS      bool    `json:"ignore_eos"`
		ReturnTokenIDs bool    `json:"return_token_ids"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || !req.Stream || !req.IgnoreEOS || !req.ReturnTokenIDs || req.MaxTokens < 1 {
		http.Error(w, fmt.Sprintf("bad request %+v: %v", req, err), http.StatusBadRequest)
		return
	}
	if f.enter != nil {
		f.enter()
	}
	f.mu.Lock()
	f.inflight++
	f.maxIn = max(f.maxIn, f.inflight)
	f.prompts = append(f.prompts, req.Prompt)
	f.mu.Unlock()
	// Out of flight before the last write: the client may send its next
	// request as soon as it has read it.
	var once sync.Once
	leave := func() {
		once.Do(func() {
			if f.leave != nil {
				f.leave()
			}
			f.mu.Lock()
			f.inflight--
			f.mu.Unlock()
		})
	}
	defer leave()
	how := ""
	if f.fail != nil {
		how = f.fail(req.Prompt)
	}
	switch how {
	case "400":
		leave()
		http.Error(w, "refused", http.StatusBadRequest)
		return
	case "500":
		leave()
		http.Error(w, "broken", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for i, id := range answerOf(req.Prompt, req.MaxTokens) {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(f.gap):
		}
		if how == "event" && i == 1 {
			leave()
			fmt.Fprint(w, "data: {\"error\":{\"message\":\"engine failed\",\"code\":500}}\n\n")
			return
		}
		if how == "cut" && i == 1 {
			leave()
			return
		}
		fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"x\",\"token_ids\":[%d]}]}\n\n", id)
		fl.Flush()
	}
	fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"completion_tokens\":%d,\"kvxfer_timing\":{\"kv_transfer_ms\":0.5,\"kv_transfer_bytes\":%d}}}\n\n", req.MaxTokens, 64*len(req.Prompt))
	leave()
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

func startFake(t *testing.T, f http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return srv.URL
}

func testOptions(t *testing.T, url string, n int) Options {
	return Options{Target: Target{Name: TargetDisaggregated, URL: url}, Burstiness: 1,
		Workload: Workload{Seed: 5, NumPrompts: n, Turns: 1, Input: mustLengths(t, "uniform:8-64", false), Output: mustLengths(t, "uniform:1-6", true)}}
}

// TestRunConcurrency: at most MaxConcurrency requests in flight (and that
// many reached), every request sent once and measured.
func TestRunConcurrency(t *testing.T) {
	f := &fakeServer{gap: 2 * time.Millisecond}
	o := testOptions(t, startFake(t, f), 30)
	o.MaxConcurrency = 3
	recs, d, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 30 || len(f.prompts) != 30 || f.maxIn != 3 {
		t.Fatalf("%d records, %d requests, %d at most in flight; want 30, 30, 3", len(recs), len(f.prompts), f.maxIn)
	}
	for _, r := range recs {
		if !r.OK() || r.OutputTokens != r.MaxTokens || r.TTFT <= 0 || r.E2EL < r.TTFT || len(r.ITL) != r.MaxTokens-1 || r.Sent+r.E2EL > d {
			t.Fatalf("record %+v (run of %v)", r, d)
		}
	}
}

// TestRunMultiTurn: turn n resends turn n−1's prompt and answer, then its
// own user text; the server sees exactly Prompt's history.
func TestRunMultiTurn(t *testing.T) {
	f := &fakeServer{gap: time.Millisecond}
	o := testOptions(t, startFake(t, f), 12)
	o.Workload.Turns, o.Workload.SystemPromptLen = 4, 10
	recs, _, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 12 {
		t.Fatalf("%d records, want 12", len(recs))
	}
	sys, convs := o.Workload.SystemPrompt(), o.Workload.Conversations()
	for ci, c := range convs {
		var answers [][]int32
		for ti := range c.Turns {
			want := Prompt(sys, c, ti, answers)
			if !slices.ContainsFunc(f.prompts, func(p []int32) bool { return slices.Equal(p, want) }) {
				t.Fatalf("conversation %d turn %d: its prompt with history (%d tokens) was never sent", ci, ti, len(want))
			}
			answers = append(answers, answerOf(want, c.Turns[ti].MaxTokens))
		}
	}
}

// TestRunDuration: no request is sent after Duration; those in flight
// finish.
func TestRunDuration(t *testing.T) {
	f := &fakeServer{gap: time.Millisecond}
	o := testOptions(t, startFake(t, f), 10000)
	o.Rate, o.Duration = 50, 300*time.Millisecond
	start := time.Now()
	recs, _, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(recs); n < 2 || n > 40 {
		t.Errorf("%d requests in 300 ms at 50/s", n)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("Run took %v with a duration of 300 ms", el)
	}
	for _, r := range recs {
		if r.Sent > o.Duration {
			t.Errorf("a request sent at %v, after the duration", r.Sent)
		}
	}
}

// TestRunDurationWaiting: with every conversation started at once and a
// bound on concurrency, those still waiting for a slot at Duration are
// not sent.
func TestRunDurationWaiting(t *testing.T) {
	f := &fakeServer{gap: 20 * time.Millisecond}
	o := testOptions(t, startFake(t, f), 200)
	o.MaxConcurrency, o.Duration = 2, 150*time.Millisecond
	o.Workload.Output = mustLengths(t, "3", true)
	recs, _, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	// 2 slots × 150 ms / 60 ms per request: about 6 requests.
	if n := len(recs); n < 2 || n > 20 {
		t.Errorf("%d requests sent in 150 ms with 2 slots of 60 ms requests", n)
	}
}

// TestRunErrors: failed requests are recorded by kind, and a failed turn
// ends its conversation.
func TestRunErrors(t *testing.T) {
	f := &fakeServer{gap: time.Millisecond, fail: func(p []int32) string {
		return []string{"", "400", "500", "event", "cut"}[len(p)%5]
	}}
	o := testOptions(t, startFake(t, f), 100)
	o.MaxConcurrency = 8
	recs, d, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	m := Compute(recs, d, SLO{})
	for kind, n := range m.ErrorsByKind {
		if n == 0 || !slices.Contains([]string{ErrorHTTP4xx, ErrorHTTP5xx, ErrorEvent, ErrorIncomplete}, kind) {
			t.Errorf("%d errors of kind %q", n, kind)
		}
	}
	if len(m.ErrorsByKind) != 4 || m.Completed == 0 || m.Completed+m.Failed != 100 {
		t.Errorf("completed %d failed %d by kind %v", m.Completed, m.Failed, m.ErrorsByKind)
	}

	// Nothing listens: every request is a connect error.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close()
	o = testOptions(t, url, 3)
	recs, _, _ = Run(context.Background(), o)
	if m := Compute(recs, time.Second, SLO{}); m.ErrorsByKind[ErrorConnect] != 3 {
		t.Errorf("no server: errors %v, want 3 connect", m.ErrorsByKind)
	}
}

// TestRunCancel: cancelling the run's context ends it at once, with the
// requests in flight canceled.
func TestRunCancel(t *testing.T) {
	f := &fakeServer{gap: 50 * time.Millisecond}
	o := testOptions(t, startFake(t, f), 20)
	o.Workload.Output = mustLengths(t, "100", true)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	recs, _, err := Run(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("Run took %v after its context ended", el)
	}
	if m := Compute(recs, time.Second, SLO{}); m.ErrorsByKind[ErrorTimeout]+m.ErrorsByKind[ErrorCanceled] != 20 {
		t.Errorf("errors %v, want 20 timeouts or cancels", m.ErrorsByKind)
	}
}

func TestOptionsValidate(t *testing.T) {
	good := testOptions(t, "http://x", 1)
	for _, tc := range []struct {
		name   string
		mutate func(o *Options)
	}{
		{"no URL", func(o *Options) { o.Target.URL = "" }},
		{"negative rate", func(o *Options) { o.Rate = -1 }},
		{"zero burstiness", func(o *Options) { o.Burstiness = 0 }},
		{"negative concurrency", func(o *Options) { o.MaxConcurrency = -1 }},
		{"no prompts", func(o *Options) { o.Workload.NumPrompts = 0 }},
		{"no turns", func(o *Options) { o.Workload.Turns = 0 }},
		{"unparsed lengths", func(o *Options) { o.Workload.Input = Lengths{} }},
		{"negative warm-up", func(o *Options) { o.Warmup = -1 }},
	} {
		o := good
		tc.mutate(&o)
		if err := o.validate(); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
	if err := good.validate(); err != nil {
		t.Errorf("good options refused: %v", err)
	}
}

// TestRunPaired: every conversation goes to each target, one request at a
// time, the order rotating; both targets get the same prompts.
func TestRunPaired(t *testing.T) {
	var mu sync.Mutex
	var order []string
	var inflight, maxIn int
	mk := func(name string) string {
		return startFake(t, &fakeServer{gap: time.Millisecond, enter: func() {
			mu.Lock()
			order = append(order, name)
			inflight++
			maxIn = max(maxIn, inflight)
			mu.Unlock()
		}, leave: func() {
			mu.Lock()
			inflight--
			mu.Unlock()
		}})
	}
	a, b := mk("a"), mk("b")
	o := testOptions(t, a, 6)
	o.Workload.Turns = 2
	recs, spent, err := RunPaired(context.Background(), o, []Target{{Name: TargetDisaggregated, URL: a}, {Name: TargetAggregated, URL: b}})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"}; !slices.Equal(order, want) {
		t.Errorf("order %v, want %v", order, want)
	}
	if maxIn != 1 || len(recs) != 2 || len(recs[0]) != 6 || len(recs[1]) != 6 || spent[0] <= 0 || spent[1] <= 0 {
		t.Fatalf("%d in flight at most, records %d/%d, spent %v", maxIn, len(recs[0]), len(recs[1]), spent)
	}
	for i := range recs[0] {
		if recs[0][i].PromptTokens != recs[1][i].PromptTokens || recs[0][i].Conversation != recs[1][i].Conversation {
			t.Errorf("request %d: prompts of %d and %d tokens", i, recs[0][i].PromptTokens, recs[1][i].PromptTokens)
		}
	}
}
