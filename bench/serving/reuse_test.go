package serving

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// naiveNewBlocks is NewBlocks written another way: block by block, a
// block of the prompt is cached when it is full, lies within the first
// len(prompt)−1 tokens, within held, equals held's block at the same
// place, and every block before it is cached.
func naiveNewBlocks(held, prompt []int32, tpb int) int {
	if tpb <= 0 || len(prompt) == 0 {
		return 0
	}
	total := 0
	for i := 0; i < len(prompt); i += tpb {
		total++
	}
	cached := 0
	for b := 0; ; b++ {
		end := (b + 1) * tpb
		if end > len(prompt)-1 || end > len(held) || !slices.Equal(held[b*tpb:end], prompt[b*tpb:end]) {
			break
		}
		cached++
	}
	return total - cached
}

func TestNewBlocks(t *testing.T) {
	seq := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(i % 200)
		}
		return out
	}
	diverge := func(s []int32, at int) []int32 {
		c := slices.Clone(s)
		c[at] = 999
		return c
	}
	for _, tc := range []struct {
		name         string
		held, prompt []int32
		tpb, want    int
	}{
		{"first turn: every block", nil, seq(100), 32, 4},
		{"first turn, exact blocks", nil, seq(96), 32, 3},
		{"history of 70 tokens: 2 full blocks cached", seq(70), seq(130), 32, 5 - 2},
		{"history of 64: 2 blocks", seq(64), seq(65), 32, 3 - 2},
		{"the last prompt token is never cached", seq(64), seq(64), 32, 2 - 1},
		{"divergence in block 1", seq(128), diverge(seq(160), 40), 32, 5 - 1},
		{"divergence at token 0", seq(128), diverge(seq(160), 0), 32, 5},
		{"one token per block", seq(10), seq(12), 1, 12 - 10},
		{"no block size: nothing counted", seq(10), seq(12), 0, 0},
		{"empty prompt", seq(10), nil, 32, 0},
	} {
		if got := NewBlocks(tc.held, tc.prompt, tc.tpb); got != tc.want {
			t.Errorf("%s: NewBlocks = %d, want %d", tc.name, got, tc.want)
		}
		if got := naiveNewBlocks(tc.held, tc.prompt, tc.tpb); got != tc.want {
			t.Errorf("%s: the naive reference says %d, want %d (the table is wrong)", tc.name, got, tc.want)
		}
	}
}

// TestNewBlocksAgainstNaive: NewBlocks equals the block-by-block
// reference on random histories and prompts that share a prefix of any
// length, at several block sizes.
func TestNewBlocksAgainstNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		tpb := []int{1, 2, 3, 7, 16, 32}[r.IntN(6)]
		held := make([]int32, r.IntN(120))
		for j := range held {
			held[j] = int32(r.IntN(3))
		}
		shared := r.IntN(len(held) + 1)
		prompt := slices.Clone(held[:shared])
		for range r.IntN(80) {
			prompt = append(prompt, int32(r.IntN(3)))
		}
		if got, want := NewBlocks(held, prompt, tpb), naiveNewBlocks(held, prompt, tpb); got != want {
			t.Fatalf("case %d: NewBlocks(held %v, prompt %v, %d) = %d, naive %d", i, held, prompt, tpb, got, want)
		}
	}
}

func TestHeldTokens(t *testing.T) {
	prompt, answer := []int32{1, 2, 3}, []int32{7, 8, 9}
	held := HeldTokens(prompt, answer)
	if want := []int32{1, 2, 3, 7, 8}; !slices.Equal(held, want) {
		t.Fatalf("HeldTokens = %v, want %v (the last answer token has no KV)", held, want)
	}
	held[0] = 42
	if prompt[0] != 1 {
		t.Fatal("HeldTokens aliases the prompt")
	}
	if got := HeldTokens(prompt, nil); !slices.Equal(got, prompt) {
		t.Fatalf("HeldTokens without an answer = %v, want the prompt", got)
	}
}

func TestBlockBytes(t *testing.T) {
	for _, tc := range []struct {
		name     string
		r        Record
		want     int64
		reported bool
	}{
		{"no timing", Record{PromptBlocks: 4}, 0, false},
		{"nothing moved (local)", Record{PromptBlocks: 4, Timing: &Timing{KVBlockBytes: 100}}, 0, false},
		{"reported", Record{PromptBlocks: 4, Timing: &Timing{KVTransferBytes: 300, KVTransferBlocks: 3, KVBlockBytes: 100}}, 100, true},
		{"from the blocks asked for", Record{PromptBlocks: 4, Timing: &Timing{KVTransferBytes: 300, KVTransferBlocks: 3}}, 100, false},
		{"no reuse reported: every block moved", Record{PromptBlocks: 4, Timing: &Timing{KVTransferBytes: 400}}, 100, false},
		{"cached_tokens 0: every block moved", Record{PromptBlocks: 4, HasCached: true, Timing: &Timing{KVTransferBytes: 400}}, 100, false},
		{"reuse reported without a block size: unknown", Record{PromptBlocks: 4, HasCached: true, CachedTokens: 64,
			Timing: &Timing{KVTransferBytes: 200}}, 0, false},
		{"no block accounting", Record{Timing: &Timing{KVTransferBytes: 400}}, 0, false},
	} {
		got, rep := blockBytes(&tc.r)
		if got != tc.want || rep != tc.reported {
			t.Errorf("%s: blockBytes = %d, %v; want %d, %v", tc.name, got, rep, tc.want, tc.reported)
		}
	}
}

// TestComputeReuse: the per-turn and per-path aggregation of hand-made
// records; failed requests count nowhere.
func TestComputeReuse(t *testing.T) {
	ms := time.Millisecond
	rec := func(turn, prompt, cached int, path string, moved, bb int64, newBlocks int, ttft time.Duration) Record {
		r := Record{Turn: turn, PromptTokens: prompt, CachedTokens: cached, HasCached: true, Path: path, PromptBlocks: (prompt + 31) / 32,
			NewBlocks: newBlocks, TTFT: ttft, E2EL: 2 * ttft, OutputTokens: 1, Timing: &Timing{KVTransferBytes: moved, KVBlockBytes: bb}}
		if moved > 0 {
			r.Timing.KVTransferBlocks = int(moved / bb)
		}
		return r
	}
	records := []Record{
		rec(0, 100, 0, PathDisaggregated, 400, 100, 4, 10*ms),
		rec(0, 100, 64, PathDisaggregated, 200, 100, 4, 20*ms), // moved 2 of 4 new: the server did better
		rec(1, 200, 96, PathLocal, 0, 0, 4, 5*ms),
		rec(1, 200, 96, PathDisaggregated, 550, 100, 4, 30*ms),
		{Turn: 1, PromptTokens: 999, ErrorKind: ErrorHTTP5xx, Error: "broken"},
		rec(2, 300, 288, "", 100, 100, 1, 7*ms),
	}
	m := Compute(records, time.Second, SLO{})
	if m.CachedTokens != 64+96+96+288 || m.CachedReported != 5 {
		t.Fatalf("cached %d over %d answers, want %d over 5", m.CachedTokens, m.CachedReported, 64+96+96+288)
	}
	if want := float64(64+96+96+288) / float64(100+100+200+200+300); m.PrefixHitRate == nil || *m.PrefixHitRate != want {
		t.Fatalf("prefix hit rate %v, want %v", m.PrefixHitRate, want)
	}
	// Moved over new, over the requests that moved KV: (400+200+550+100) / ((4+4+4+1)·100).
	if want := 1250.0 / 1300; m.MovedOverNew == nil || *m.MovedOverNew != want {
		t.Fatalf("moved over new %v, want %v", m.MovedOverNew, want)
	}
	if len(m.PerTurn) != 3 {
		t.Fatalf("%d turns, want 3: %+v", len(m.PerTurn), m.PerTurn)
	}
	t1 := m.PerTurn[1]
	if t1.Turn != 1 || t1.Completed != 2 || t1.PromptTokens != 400 || t1.CachedTokens != 192 || *t1.PrefixHitRate != 192.0/400 ||
		t1.KVBytes.N != 2 || t1.KVBytes.Mean != 275 || t1.NewBytes.N != 2 || t1.NewBytes.Mean != 400 || *t1.MovedOverNew != 550.0/400 ||
		t1.TTFT.N != 2 || t1.TTFT.P50 != 17.5 {
		t.Fatalf("turn 1: %+v", t1)
	}
	if t0 := m.PerTurn[0]; *t0.MovedOverNew != 600.0/800 || t0.NewBlocks.Mean != 4 {
		t.Fatalf("turn 0: %+v", t0)
	}
	var paths []string
	for _, p := range m.ByPath {
		paths = append(paths, fmt.Sprintf("%s:%d:%.1f", p.Path, p.Completed, p.TTFT.P50))
	}
	if want := []string{"disaggregated:3:20.0", "local:1:5.0", "unknown:1:7.0"}; !slices.Equal(paths, want) {
		t.Fatalf("by path %v, want %v", paths, want)
	}
	// No header at all: no split; no cached_tokens: no hit rate.
	for i := range records {
		records[i].Path, records[i].HasCached, records[i].CachedTokens = "", false, 0
	}
	m = Compute(records, time.Second, SLO{})
	if len(m.ByPath) != 0 || m.PrefixHitRate != nil || m.PerTurn[0].PrefixHitRate != nil || m.CachedReported != 0 {
		t.Fatalf("without headers and cached_tokens: by path %+v, hit rate %v", m.ByPath, m.PrefixHitRate)
	}
}

// reuseServer is a fake router with prefix reuse: it remembers, per
// conversation id, what the last turn left cached, reports the prompt
// tokens it finds cached (whole blocks, block by block), moves only the
// new blocks (kv_transfer_blocks, kv_block_bytes), runs a request whose
// uncached part is at most local tokens locally (X-Kvxfer-Route: local,
// nothing moved), and answers with random tokens the client cannot
// predict.
type reuseServer struct {
	tpb, local int
	blockBytes int64
	field      string // where the conversation id is read

	mu     sync.Mutex
	rng    *rand.Rand
	held   map[string][]int32 // conversation id -> tokens held
	turns  map[string][]turnSeen
	order  []string // conversation ids in the order requests arrived
	failed []string // what the fake found wrong
}

// turnSeen is one request of a conversation as the fake saw it.
type turnSeen struct {
	prompt, answer []int32
	arrived, done  time.Time
}

func newReuseServer(tpb, local int, field string) *reuseServer {
	return &reuseServer{tpb: tpb, local: local, blockBytes: 1000, field: field, rng: rand.New(rand.NewPCG(9, 9)),
		held: map[string][]int32{}, turns: map[string][]turnSeen{}}
}

func (f *reuseServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	var req struct {
		Prompt         []int32 `json:"prompt"`
		MaxTokens      int     `json:"max_tokens"`
		ConversationID string  `json:"conversation_id"`
		Disagg         *struct {
			ConversationID string `json:"conversation_id"`
		} `json:"disaggregated_params"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id := req.ConversationID
	if f.field == ConversationFieldDisagg {
		if req.Disagg == nil || id != "" {
			http.Error(w, "want the id in disaggregated_params only", http.StatusBadRequest)
			return
		}
		id = req.Disagg.ConversationID
	}
	if id == "" {
		http.Error(w, "no conversation id", http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	held := f.held[id]
	prev := f.turns[id]
	if n := len(prev); n > 0 {
		// Turn n must carry turn n−1's prompt and the answer this server
		// returned, and come after it finished.
		last := prev[n-1]
		if want := slices.Concat(last.prompt, last.answer); !slices.Equal(req.Prompt[:min(len(want), len(req.Prompt))], want) {
			f.failed = append(f.failed, fmt.Sprintf("%s turn %d does not start with turn %d's prompt and answer", id, n, n-1))
		}
		if arrived.Before(last.done) {
			f.failed = append(f.failed, fmt.Sprintf("%s turn %d arrived before turn %d finished", id, n, n-1))
		}
	}
	newBlocks := naiveNewBlocks(held, req.Prompt, f.tpb)
	total := (len(req.Prompt) + f.tpb - 1) / f.tpb
	cached := (total - newBlocks) * f.tpb
	answer := make([]int32, req.MaxTokens)
	for i := range answer {
		answer[i] = int32(f.rng.IntN(256))
	}
	f.order = append(f.order, id)
	f.mu.Unlock()

	path, moved := PathDisaggregated, int64(newBlocks)*f.blockBytes
	timing := fmt.Sprintf(`{"kv_transfer_ms":0.1,"kv_transfer_bytes":%d,"kv_transfer_blocks":%d,"kv_block_bytes":%d}`, moved, newBlocks, f.blockBytes)
	if len(req.Prompt)-cached <= f.local {
		path, timing = PathLocal, `{"kv_transfer_ms":0,"kv_transfer_bytes":0}`
	}
	w.Header().Set(PathHeader, path)
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for _, id := range answer {
		fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"x\",\"token_ids\":[%d]}]}\n\n", id)
		fl.Flush()
	}
	fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d},\"kvxfer_timing\":%s}}\n\n",
		len(req.Prompt), len(answer), cached, timing)
	f.mu.Lock()
	f.held[id] = HeldTokens(req.Prompt, answer)
	f.turns[id] = append(f.turns[id], turnSeen{prompt: req.Prompt, answer: answer, arrived: arrived, done: time.Now()})
	f.mu.Unlock()
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

// reuseOptions: 6 conversations of 4 turns after a 100-token system
// prompt, all at once, 3 in flight.
func reuseOptions(t *testing.T, url string) Options {
	o := testOptions(t, url, 24)
	o.Workload.Turns, o.Workload.SystemPromptLen = 4, 100
	o.Workload.Input, o.Workload.Output = mustLengths(t, "uniform:8-80", false), mustLengths(t, "uniform:2-20", true)
	o.MaxConcurrency, o.TokensPerBlock = 3, 16
	return o
}

// TestRunCarriesHistory: against a server whose answers the client
// cannot predict, turn n's prompt is turn n−1's prompt and the answer the
// server returned, sent after turn n−1 finished; each conversation keeps
// one id, its own; conversations interleave; the id goes where
// ConversationField says.
func TestRunCarriesHistory(t *testing.T) {
	for _, field := range []string{"", ConversationFieldDisagg} {
		f := newReuseServer(16, 0, field)
		o := reuseOptions(t, startFake(t, f))
		o.ConversationField = field
		recs, _, err := Run(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		if len(f.failed) > 0 {
			t.Fatalf("field %q: %s", field, strings.Join(f.failed, "\n"))
		}
		if len(recs) != 24 || len(f.turns) != 6 {
			t.Fatalf("field %q: %d records, %d conversation ids; want 24 and 6", field, len(recs), len(f.turns))
		}
		for id, turns := range f.turns {
			if len(turns) != 4 {
				t.Fatalf("conversation %s: %d turns under its id, want 4", id, len(turns))
			}
		}
		// Interleaved: another conversation's turn came between the first
		// and the last turn of some conversation.
		interleaved := false
		for id := range f.turns {
			first, last := -1, -1
			for i, o := range f.order {
				if o == id {
					last = i
					if first < 0 {
						first = i
					}
				}
			}
			interleaved = interleaved || slices.ContainsFunc(f.order[first:last+1], func(o string) bool { return o != id })
		}
		if !interleaved {
			t.Fatalf("field %q: conversations did not interleave: %v", field, f.order)
		}
	}
}

// TestRunReuseFigures: against the reuse fake, the bench's own count of
// new blocks equals what the server moved (ratio exactly 1 per turn), the
// prefix-hit rate is the server's, and TTFT splits by path.
func TestRunReuseFigures(t *testing.T) {
	f := newReuseServer(16, 40, "")
	o := reuseOptions(t, startFake(t, f))
	recs, d, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	m := Compute(recs, d, SLO{})
	if m.Completed != 24 || len(m.PerTurn) != 4 {
		t.Fatalf("%d completed, %d turns", m.Completed, len(m.PerTurn))
	}
	var cached, prompt int
	for _, r := range recs {
		cached += r.CachedTokens
		prompt += r.PromptTokens
		if r.Path == PathDisaggregated && int64(r.NewBlocks)*f.blockBytes != r.Timing.KVTransferBytes {
			t.Fatalf("conversation %d turn %d: the bench counts %d new blocks, the server moved %d bytes", r.Conversation, r.Turn,
				r.NewBlocks, r.Timing.KVTransferBytes)
		}
	}
	if cached == 0 || *m.PrefixHitRate != float64(cached)/float64(prompt) {
		t.Fatalf("prefix hit rate %v, want %d/%d", *m.PrefixHitRate, cached, prompt)
	}
	for _, tm := range m.PerTurn {
		if tm.MovedOverNew != nil && *tm.MovedOverNew != 1 {
			t.Fatalf("turn %d: moved over new %v, want 1", tm.Turn, *tm.MovedOverNew)
		}
		if tm.Turn > 0 && (tm.PrefixHitRate == nil || *tm.PrefixHitRate < 0.5) {
			t.Fatalf("turn %d: prefix hit rate %v, want most of the prompt", tm.Turn, tm.PrefixHitRate)
		}
	}
	if pathOf(m.ByPath, PathLocal) == nil || pathOf(m.ByPath, PathDisaggregated) == nil || pathOf(m.ByPath, PathUnknown) != nil {
		t.Fatalf("by path %+v, want local and disaggregated", m.ByPath)
	}
}

// TestReuseReport: a sweep against the reuse fake writes a report that
// validates against the schema, with per-turn and per-path figures in
// every output.
func TestReuseReport(t *testing.T) {
	url := startFake(t, newReuseServer(16, 40, ""))
	o := reuseOptions(t, url)
	rep, err := RunSweep(context.Background(), Sweep{Base: o, Rates: []float64{0}, Targets: []Target{{Name: TargetDisaggregated, URL: url}},
		Command: []string{"kvxfer", "bench", "serve"}, Setup: "a fake server"})
	if err != nil {
		t.Fatal(err)
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	sch := compileSchema(t)
	if err := validate(sch, js.Bytes()); err != nil {
		t.Fatalf("the report does not validate: %v\n%s", err, js.String())
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Runs[0].PerTurn) != 4 || len(back.Runs[0].ByPath) != 2 ||
		back.Config.TokensPerBlock != 16 || back.Config.ConversationField != ConversationFieldTop {
		t.Fatalf("decoding: %v; %+v", err, back.Config)
	}
	var img bytes.Buffer
	if err := rep.WritePNG(&img); err != nil {
		t.Fatal(err)
	}
	if cfg, err := png.DecodeConfig(&img); err != nil || cfg.Width != 18*144 || cfg.Height != 5*144 {
		t.Fatalf("the chart: %+v, %v; want one row of three 6×5-inch charts at 144 dpi", cfg, err)
	}
	var table, md, summary bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteReuseSummary(&summary); err != nil {
		t.Fatal(err)
	}
	for _, out := range []struct {
		name string
		text string
		want []string
	}{
		{"table", table.String(), []string{"PREFIX HIT", "per turn:", "1.00×", "LOCAL/DISAGG"}},
		{"markdown", md.String(), []string{"## Prefix reuse", "### disaggregated @ concurrency 3, per turn", "1.00×"}},
		{"summary", summary.String(), []string{"| disaggregated @ concurrency 3 | 24 / 24 |", "1.00×", "`kvxfer bench serve`", " → "}},
	} {
		for _, w := range out.want {
			if !strings.Contains(out.text, w) {
				t.Errorf("%s lacks %q:\n%s", out.name, w, out.text)
			}
		}
	}
	// What the schema holds the reuse fields to.
	for _, tc := range []struct{ name, from, to string }{
		{"hit rate above 1", `"prefix_hit_rate": `, `"prefix_hit_rate": 1.5, "x_": `},
		{"unknown conversation field", `"conversation_id_field": "conversation_id"`, `"conversation_id_field": "body"`},
		{"a turn without its index", `"turn": 0,`, ``},
	} {
		bad := strings.Replace(js.String(), tc.from, tc.to, 1)
		if bad == js.String() {
			t.Fatalf("%s: %q not in the report", tc.name, tc.from)
		}
		if err := validate(sch, []byte(bad)); err == nil {
			t.Errorf("%s: the schema accepts it", tc.name)
		}
	}
}

func TestCommandFor(t *testing.T) {
	rep := &Report{Command: []string{"kvxfer", "bench", "serve", "-f", "a.yaml", "-f", "b.yaml", "--turns", "6", "--json", "x.json",
		"--md=x.md", "--png", "x.png", "--readme", "README.md"},
		Config: Config{Targets: []Target{{Name: TargetDisaggregated, Cluster: "a.yaml"}, {Name: TargetDisaggregated, Cluster: "b.yaml"}}}}
	run := &Result{Target: rep.Config.Targets[1]}
	if got, want := rep.CommandFor(run), "kvxfer bench serve -f b.yaml --turns 6"; got != want {
		t.Fatalf("CommandFor = %q, want %q", got, want)
	}
	one := &Report{Command: []string{"kvxfer", "bench", "serve", "-f", "a.yaml", "--json", "x.json"}, Config: Config{Targets: []Target{{Name: TargetDisaggregated}}}}
	if got, want := one.CommandFor(&Result{Target: one.Config.Targets[0]}), "kvxfer bench serve -f a.yaml"; got != want {
		t.Fatalf("CommandFor of one cluster = %q, want %q", got, want)
	}
}

func TestMerge(t *testing.T) {
	a := &Report{Runs: []*Result{{Target: Target{Name: TargetDisaggregated, Cluster: "a.yaml"}}}, Failed: 1, DurationS: 2,
		Config: Config{Setup: "A", Targets: []Target{{Name: TargetDisaggregated, Cluster: "a.yaml"}}}}
	b := &Report{Runs: []*Result{{Target: Target{Name: TargetDisaggregated, Cluster: "b.yaml"}}}, Failed: 2, DurationS: 3,
		Config: Config{Setup: "B", Targets: []Target{{Name: TargetDisaggregated, Cluster: "b.yaml"}}}}
	m := Merge(a, b)
	if len(m.Runs) != 2 || m.Failed != 3 || m.DurationS != 5 || m.Config.Setup != "A; B" || len(m.Config.Targets) != 2 || len(a.Runs) != 1 {
		t.Fatalf("Merge = %+v", m)
	}
	if m.Runs[1].Label() != "b @ all at once" {
		t.Fatalf("label %q", m.Runs[1].Label())
	}
}

// TestReadStreamReuseUsage: cached_tokens and the block fields of
// kvxfer_timing are read from the usage chunk; their absence reads as
// absent, not 0.
func TestReadStreamReuseUsage(t *testing.T) {
	start := time.Unix(0, 0)
	now := func() time.Time { return start.Add(time.Millisecond) }
	with := "data: {\"choices\":[{\"token_ids\":[5]}]}\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":96}," +
		"\"kvxfer_timing\":{\"kv_transfer_bytes\":3000,\"kv_transfer_blocks\":3,\"kv_block_bytes\":1000}}}\n\ndata: [DONE]\n\n"
	a, err := readStream(strings.NewReader(with), start, now)
	if err != nil || a.cached != 96 || a.timing == nil || a.timing.KVTransferBlocks != 3 || a.timing.KVBlockBytes != 1000 {
		t.Fatalf("with: %+v, %v", a, err)
	}
	without := "data: {\"choices\":[{\"token_ids\":[5]}]}\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":1,\"prompt_tokens_details\":{}}}\n\ndata: [DONE]\n\n"
	if a, err = readStream(strings.NewReader(without), start, now); err != nil || a.cached != -1 {
		t.Fatalf("without: cached %d, %v; want -1", a.cached, err)
	}
}

// TestNoReuseSection: a report of single-turn requests without a system
// prompt (nothing shared) has no reuse table or section.
func TestNoReuseSection(t *testing.T) {
	rep := sweepReport(t)
	var table, md bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(table.String(), "PREFIX HIT") || strings.Contains(md.String(), "Prefix reuse") {
		t.Fatalf("a reuse section without reuse:\n%s\n%s", table.String(), md.String())
	}
}
