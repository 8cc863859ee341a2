package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/serve"
)

// Process-level tests of the router policies of issue 18 on TensorRT-LLM's
// own cluster files (config/testdata/upstream), run by kvxfer up with the
// urls removed (the launcher picks free ports).
//
// The engine does not reuse blocks yet (engine.CachedPrefix is 0, no
// events), so these assert the routing each policy does now, and the
// cache hits only when the workers report some: the assertions marked
// "with reuse" run once they do.

var reuseSecret = []byte("reuse tests' cluster secret, 32+ bytes long")

// launchUpstream starts the upstream cluster file name with an aggregated
// worker beside it.
func launchUpstream(t *testing.T, name string) *launch.Launched {
	t.Helper()
	f, err := config.LoadFile(filepath.Join("..", "..", "config", "testdata", "upstream", name), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	cl := f.Cluster
	cl.Port, cl.Context.URLs, cl.Generation.URLs = -1, nil, nil
	logs := &syncbuf.Buffer{}
	l, err := launch.Start(context.Background(), launch.Options{Cluster: cl, Aggregated: true, Secret: reuseSecret,
		Command: []string{os.Args[0]}, Env: []string{"KVXFER_CLI_CHILD=1"}, Output: logs, Ready: 60 * time.Second})
	if err != nil {
		t.Fatalf("launch %s: %v\n%s", name, err, logs.String())
	}
	t.Cleanup(func() {
		l.Stop()
		if t.Failed() {
			t.Logf("worker logs:\n%s", logs.String())
		}
	})
	return l
}

// completion sends a completion to the router and returns its route
// header and usage.
type usage struct {
	PromptTokens int `json:"prompt_tokens"`
	Details      struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	Timing struct {
		KVTransferBytes int64 `json:"kv_transfer_bytes"`
	} `json:"kvxfer_timing"`
}

func complete(t *testing.T, url string, body map[string]any) (string, usage) {
	t.Helper()
	body["max_tokens"], body["ignore_eos"] = 4, true
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	var r struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return resp.Header.Get(serve.RouteHeader), r.Usage
}

// served is how many completions each worker has answered (its
// kvxfer_http_requests_total for POST /v1/completions, 200).
func served(t *testing.T, urls []string) []int {
	t.Helper()
	out := make([]int, len(urls))
	for i, u := range urls {
		_, m := httpGet(t, u+"/metrics", "")
		const key = `kvxfer_http_requests_total{code="200",route="POST /v1/completions"} `
		if j := strings.Index(m, key); j >= 0 {
			line := m[j+len(key):]
			out[i], _ = strconv.Atoi(strings.TrimSpace(line[:strings.IndexByte(line, '\n')]))
		}
	}
	return out
}

func httpGet(t *testing.T, url, auth string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// eventCount is how many KV cache events the worker at url has now.
func eventCount(t *testing.T, url string) int {
	t.Helper()
	code, body := httpGet(t, url+serve.KVEventsPath+"?after=0", "Bearer "+serve.ReuseToken(reuseSecret))
	var evs []json.RawMessage
	if code != 200 || json.Unmarshal([]byte(body), &evs) != nil {
		t.Fatalf("%s%s: %d %s", url, serve.KVEventsPath, code, body)
	}
	return len(evs)
}

// TestUpKVCacheAware: cluster_kv_cache_aware.yaml (2 context, 2
// generation workers, kv_cache_aware on both groups). The router polls the
// workers' events with the cluster's token (a worker refuses anyone
// else), answers equal the aggregated worker's, and a prompt sent again
// goes where its prefix is cached.
func TestUpKVCacheAware(t *testing.T) {
	l := launchUpstream(t, "cluster_kv_cache_aware.yaml")
	if res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 6, 2); !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
	for _, u := range append(slices.Clone(l.ContextURLs), l.GenerationURL...) {
		if code, body := httpGet(t, u+serve.KVEventsPath, ""); code != http.StatusUnauthorized {
			t.Errorf("%s%s without a token: %d %s", u, serve.KVEventsPath, code, body)
		}
	}
	prompt := "system: you are a terse assistant. " + strings.Repeat("context ", 40) + "user: what now?"
	before := served(t, l.ContextURLs)
	for range 6 {
		complete(t, l.RouterURL, map[string]any{"prompt": prompt})
		time.Sleep(30 * time.Millisecond) // a poll round (DefaultKVEventsInterval)
	}
	after := served(t, l.ContextURLs)
	d := []int{after[0] - before[0], after[1] - before[1]}
	if d[0]+d[1] != 6 {
		t.Fatalf("context workers served %v of 6", d)
	}
	// The file turns block reuse and events on: once the first request's
	// blocks are published (and polled), every request goes where the
	// prompt is cached. (Without reuse, round robin spreads them 3/3.)
	if n := eventCount(t, l.ContextURLs[0]) + eventCount(t, l.ContextURLs[1]); n == 0 {
		t.Errorf("the context workers published no KV cache events")
	}
	if min(d[0], d[1]) > 1 {
		t.Errorf("the same prompt spread over the context workers %v", d)
	}
	time.Sleep(300 * time.Millisecond)
	_, m := httpGet(t, l.RouterURL+"/metrics", "")
	if !strings.Contains(m, `kvxfer_router_upstream_requests_total{result="kv_events",role="context"}`) ||
		!strings.Contains(m, `kvxfer_router_upstream_requests_total{result="kv_events",role="generation"}`) ||
		strings.Contains(m, `result="kv_events_error"`) {
		t.Errorf("the router could not read the workers' events:\n%s", grepLines(m, "kvxfer_router_upstream"))
	}
}

// TestUpConversation: cluster_conversation.yaml (conversation on the
// context group, max_sessions 4096). Each conversation's turns go to one
// context worker, by conversation_id (disaggregated_params, as
// TensorRT-LLM's clients send it) or by the history each turn resends.
func TestUpConversation(t *testing.T) {
	l := launchUpstream(t, "cluster_conversation.yaml")
	for c := range 3 {
		before := served(t, l.ContextURLs)
		history := fmt.Sprintf("conversation %d: ", c) + strings.Repeat("earlier turns. ", 60)
		for turn := range 4 {
			history += fmt.Sprintf(" user: turn %d?", turn)
			body := map[string]any{"prompt": history}
			if c != 2 { // the last one by prefix only
				body["disaggregated_params"] = map[string]any{"conversation_id": fmt.Sprint("conv-", c)}
			}
			route, u := complete(t, l.RouterURL, body)
			if route != serve.RouteDisaggregated || u.PromptTokens == 0 {
				t.Errorf("conversation %d turn %d: route %q, usage %+v", c, turn, route, u)
			}
		}
		after := served(t, l.ContextURLs)
		if d := []int{after[0] - before[0], after[1] - before[1]}; min(d[0], d[1]) != 0 || d[0]+d[1] != 4 {
			t.Errorf("conversation %d: its turns went to the context workers %v", c, d)
		}
	}
	if res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 4, 2); !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
}

// TestUpConditional: cluster_conditional.yaml (max_local_prefill_length
// 256, kv_cache_aware generation group). A first prompt, nothing cached,
// goes through the context worker; its next turn, a short suffix on it,
// is prefilled on the generation worker without a transfer (it has the
// history cached), and a long one goes through the context worker again.
func TestUpConditional(t *testing.T) {
	l := launchUpstream(t, "cluster_conditional.yaml")
	gen := l.GenerationURL[0]
	req, _ := http.NewRequest(http.MethodPost, gen+serve.CachedPrefixPath, strings.NewReader(`{"prompt":"x"}`))
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("cached prefix without a token: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	history := "system: " + strings.Repeat("be brief and exact. ", 30)
	route, u := complete(t, l.RouterURL, map[string]any{"prompt": history})
	if route != serve.RouteDisaggregated || u.Timing.KVTransferBytes == 0 {
		t.Errorf("first turn: route %q, %d KV bytes moved", route, u.Timing.KVTransferBytes)
	}
	history += " user: and then?"
	route, u = complete(t, l.RouterURL, map[string]any{"prompt": history})
	// The generation worker has the first turn cached (it received its
	// blocks): the short uncached part runs there, nothing moves.
	if route != serve.RouteLocal || u.Timing.KVTransferBytes != 0 || u.Details.CachedTokens == 0 {
		t.Errorf("next turn: route %q, %d KV bytes moved, %d cached; want local, 0 moved, the history cached", route, u.Timing.KVTransferBytes, u.Details.CachedTokens)
	}
	// A long new part goes through the context worker again.
	history += " user: " + strings.Repeat("a much longer question. ", 20)
	if route, u = complete(t, l.RouterURL, map[string]any{"prompt": history}); route != serve.RouteDisaggregated || u.Timing.KVTransferBytes == 0 {
		t.Errorf("long next turn: route %q, %d KV bytes moved; want disaggregated", route, u.Timing.KVTransferBytes)
	}
	_, m := httpGet(t, l.RouterURL+"/metrics", "")
	if !strings.Contains(m, "kvxfer_router_prefill_path_total") {
		t.Errorf("no prefill path metric:\n%s", grepLines(m, "kvxfer_router"))
	}
	if res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 4, 2); !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
}
