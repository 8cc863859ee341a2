package cli

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bench/serving"
	"github.com/kvxfer/kvxfer/serve"
)

// TestBenchServeBadFlags: each bad flag is refused with an error naming
// it, before anything starts.
func TestBenchServeBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--num-prompts", "0"}, "--num-prompts = 0"},
		{[]string{"--input-len", "uniform:9-3"}, "--input-len"},
		{[]string{"--output-len", "zipf"}, "--output-len"},
		{[]string{"--request-rate", "-2"}, "--request-rate"},
		{[]string{"--rates", "1,fast"}, `--rates "fast"`},
		{[]string{"--burstiness", "0"}, "--burstiness"},
		{[]string{"--max-concurrency", "-1"}, "--max-concurrency"},
		{[]string{"--turns", "0"}, "--turns"},
		{[]string{"--warmup", "-1"}, "--warmup"},
		{[]string{"--timeout", "0s"}, "--timeout"},
		{[]string{"--goodput", "ttft:fast"}, "--goodput"},
		{[]string{"--goodput", "ttft:200", "itl:5"}, `"itl:5"`},
		{[]string{"stray"}, `unexpected argument "stray"`},
		{[]string{"--url", "http://localhost:1", "--compare-aggregated"}, "--aggregated-url"},
		{[]string{"--url", "http://localhost:1", "-f", "x.yaml"}, "--url and -f"},
		{[]string{"--paired"}, "--paired goes with --compare-aggregated"},
		{[]string{"--paired", "--compare-aggregated", "--rates", "1,2"}, "--paired goes with"},
		{[]string{"--paired", "--compare-aggregated", "--max-concurrency", "4"}, "--paired goes with"},
		{[]string{"--tokens-per-block", "-1"}, "--tokens-per-block = -1"},
		{[]string{"--conversation-id", "body"}, `--conversation-id "body"`},
	} {
		code, _, errOut := runWith(t, nil, append([]string{"bench", "serve"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%q: exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
}

// TestBenchServeSchema: --print-schema prints the report's schema.
func TestBenchServeSchema(t *testing.T) {
	code, out, _ := runWith(t, nil, "bench", "serve", "--print-schema")
	if code != 0 || out != serving.ReportSchema() {
		t.Errorf("exit %d, %d bytes; want the schema", code, len(out))
	}
}

// TestBenchServeCluster is `kvxfer bench serve --compare-aggregated` on
// the default cluster of kvxfer up, which it starts itself (this test
// binary is the kvxfer of the child and its workers, see TestMain): a
// few short requests through the router and to an aggregated worker,
// every one completed with its requested length, KV moved for the
// disaggregated ones only, and every report written.
func TestBenchServeCluster(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "bench", "serve", "--compare-aggregated", "--num-prompts", "6",
		"--input-len", "uniform:16-96", "--output-len", "8", "--turns", "2", "--system-prompt-len", "16", "--request-rate", "20",
		"--warmup", "1", "--goodput", "ttft:60000", "tpot:60000",
		"--json", filepath.Join(dir, "r.json"), "--md", filepath.Join(dir, "r.md"), "--png", filepath.Join(dir, "r.png"))
	cmd.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench serve: %v\n%s", err, out)
	}
	b, err := os.ReadFile(filepath.Join(dir, "r.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep serving.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 {
		t.Fatalf("%d runs, want 2\n%s", len(rep.Runs), out)
	}
	for _, run := range rep.Runs {
		if run.Completed != 6 || run.Failed != 0 || run.TotalOutput != 6*8 || run.ITL.N != 6*7 || run.Goodput == nil || run.GoodRequests != 6 {
			t.Errorf("%s: %d completed, %d failed, %d output tokens, %d ITL samples, %d good; want 6, 0, 48, 42, 6\n%s",
				run.Target.Name, run.Completed, run.Failed, run.TotalOutput, run.ITL.N, run.GoodRequests, out)
		}
	}
	if d, a := rep.Runs[0], rep.Runs[1]; d.Target.Name != serving.TargetDisaggregated || d.KVBytes.N != 6 || d.KVBytes.Mean <= 0 ||
		a.Target.Name != serving.TargetAggregated || a.KVBytes.N != 0 {
		t.Errorf("KV moved: %s %+v, %s %+v; want 6 requests that moved KV through the router, none on the aggregated worker",
			d.Target.Name, d.KVBytes, a.Target.Name, a.KVBytes)
	}
	for _, f := range []string{"r.md", "r.png"} {
		if fi, err := os.Stat(filepath.Join(dir, f)); err != nil || fi.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	if !strings.Contains(string(out), "disaggregation overhead @ 20/s") {
		t.Errorf("the table lacks the overhead line:\n%s", out)
	}
}

// TestBenchServeURL is bench serve against running servers (--url, and
// --aggregated-url for the comparison): a cluster this test started, with
// an SLO no request can meet (goodput 0) and one every request meets.
// The cluster is bench/serving's TP1 -> TP1 file, the one for the
// disaggregation overhead next to an aggregated worker of the same layout.
func TestBenchServeURL(t *testing.T) {
	y, err := os.ReadFile("../../bench/serving/testdata/disagg_tp1.yaml")
	if err != nil {
		t.Fatal(err)
	}
	l := launchCluster(t, string(y), true)
	dir := t.TempDir()
	for _, tc := range []struct {
		slo  string
		good int
	}{{"ttft:0.001", 0}, {"e2el:600000", 4}} {
		code, out, errOut := runWith(t, nil, "bench", "serve", "--url", l.RouterURL, "--compare-aggregated", "--aggregated-url",
			l.AggregatedURL, "--num-prompts", "4", "--input-len", "32", "--output-len", "4", "--max-concurrency", "2",
			"--goodput", tc.slo, "--json", filepath.Join(dir, "r.json"))
		if code != 0 {
			t.Fatalf("%s: exit %d\n%s\n%s", tc.slo, code, out, errOut)
		}
		b, err := os.ReadFile(filepath.Join(dir, "r.json"))
		if err != nil {
			t.Fatal(err)
		}
		var rep serving.Report
		if err := json.Unmarshal(b, &rep); err != nil {
			t.Fatal(err)
		}
		if len(rep.Runs) != 2 || rep.Runs[0].Target.URL != l.RouterURL || rep.Runs[1].Target.URL != l.AggregatedURL {
			t.Fatalf("%s: runs %+v", tc.slo, rep.Runs)
		}
		for _, run := range rep.Runs {
			if run.Completed != 4 || run.GoodRequests != tc.good || run.Goodput == nil {
				t.Errorf("%s: %s: %d completed, %d good; want 4, %d", tc.slo, run.Target.Name, run.Completed, run.GoodRequests, tc.good)
			}
		}
	}
}

// TestBenchServeReuse is bench serve comparing two cluster files (-f
// twice), as make bench-reuse does: each cluster started, measured and
// stopped in turn, one report with a run per file, the per-turn reuse
// figures (the bench's own count of new blocks, with a block size it
// knows), and the README section written between its markers with a
// command per row.
func TestBenchServeReuse(t *testing.T) {
	dir := t.TempDir()
	readme := filepath.Join(dir, "README.md")
	if err := os.WriteFile(readme, []byte("# x\n"+serving.ReuseBeginMarker+"\nold\n"+serving.ReuseEndMarker+"\nend\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	on, off := "../../examples/reuse/reuse_on.yaml", "../../examples/reuse/reuse_off.yaml"
	cmd := exec.CommandContext(ctx, os.Args[0], "bench", "serve", "-f", on, "-f", off, "--num-prompts", "6", "--turns", "3",
		"--system-prompt-len", "40", "--input-len", "uniform:8-40", "--output-len", "8", "--warmup", "0",
		"--json", filepath.Join(dir, "r.json"), "--readme", readme)
	cmd.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench serve: %v\n%s", err, out)
	}
	b, err := os.ReadFile(filepath.Join(dir, "r.json"))
	if err != nil {
		t.Fatal(err)
	}
	var rep serving.Report
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 || rep.Runs[0].Target.Cluster != on || rep.Runs[1].Target.Cluster != off || rep.Config.TokensPerBlock != 32 {
		t.Fatalf("runs %d, tokens per block %d\n%s", len(rep.Runs), rep.Config.TokensPerBlock, out)
	}
	for _, run := range rep.Runs {
		if run.Completed != 6 || len(run.PerTurn) != 3 || run.NewBlockBytes.N != 6 || run.MovedOverNew == nil || *run.MovedOverNew <= 0 {
			t.Errorf("%s: %d completed, %d turns, new bytes %+v, moved/new %v\n%s", run.Label(), run.Completed, len(run.PerTurn),
				run.NewBlockBytes, run.MovedOverNew, out)
		}
		// A follow-up turn's new blocks are fewer than its prompt's.
		if t1 := run.PerTurn[1]; t1.NewBlocks.N == 0 || t1.NewBlocks.Mean*32 >= float64(t1.PromptTokens)/float64(t1.Completed) {
			t.Errorf("%s: turn 1: %+v new blocks for %d prompt tokens", run.Label(), t1.NewBlocks, t1.PromptTokens)
		}
	}
	md, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| reuse_on @ all at once |", "`kvxfer bench serve -f " + off + " ", "\nend\n"} {
		if !strings.Contains(string(md), want) || strings.Contains(string(md), "\nold\n") {
			t.Errorf("the README lacks %q or keeps the old section:\n%s", want, md)
		}
	}
}

// TestBenchServeReadsTheRoutersPathHeader: bench/serving cannot import
// serve, so it names the router's path header and values itself; they
// must be the router's.
func TestBenchServeReadsTheRoutersPathHeader(t *testing.T) {
	if serving.PathHeader != serve.RouteHeader || serving.PathLocal != serve.RouteLocal || serving.PathDisaggregated != serve.RouteDisaggregated {
		t.Errorf("bench serve reads %s: %s|%s; the router writes %s: %s|%s", serving.PathHeader, serving.PathLocal, serving.PathDisaggregated,
			serve.RouteHeader, serve.RouteLocal, serve.RouteDisaggregated)
	}
}
