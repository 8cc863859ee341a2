package serving

import (
	"bytes"
	"context"
	"encoding/json"
	"image/png"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/kvxfer/kvxfer/bench/benchtest"
)

const schemaID = "https://github.com/kvxfer/kvxfer/bench/serving/report.schema.json"

func compileSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	return benchtest.CompileSchema(t, schemaID, ReportSchema())
}

func validate(sch *jsonschema.Schema, data []byte) error { return benchtest.Validate(sch, data) }

// sweepReport runs a small sweep of two targets (the same fake server)
// at two rates, with some failures and an SLO.
func sweepReport(t *testing.T) *Report {
	t.Helper()
	f := &fakeServer{gap: time.Millisecond, fail: func(p []int32) string {
		if len(p)%3 == 0 {
			return "500"
		}
		return ""
	}}
	url := startFake(t, f)
	o := testOptions(t, url, 12)
	o.SLO = SLO{TTFTMs: 1000, TPOTMs: 100}
	o.Warmup = 1
	rep, err := RunSweep(context.Background(), Sweep{Base: o, Rates: []float64{0, 200},
		Targets: []Target{{Name: TargetDisaggregated, URL: url}, {Name: TargetAggregated, URL: url}},
		Command: []string{"kvxfer", "bench", "serve"}, Setup: "a fake server"})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestReportOutputs: the JSON validates against the schema and decodes
// back; the table, the Markdown and the PNG carry every run.
func TestReportOutputs(t *testing.T) {
	rep := sweepReport(t)
	if len(rep.Runs) != 4 || rep.Runs[0].Label() != "disaggregated @ all at once" || rep.Runs[3].Label() != "aggregated @ 200/s" {
		t.Fatalf("runs %d, first %q", len(rep.Runs), rep.Runs[0].Label())
	}
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := validate(compileSchema(t), buf.Bytes()); err != nil {
		t.Fatalf("the report does not validate: %v\n%s", err, buf.String())
	}
	var back Report
	if err := json.Unmarshal(buf.Bytes(), &back); err != nil || back.Runs[1].TTFT != rep.Runs[1].TTFT {
		t.Fatalf("decoding the report: %v", err)
	}
	var table, md, img bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WritePNG(&img); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"disaggregated", "aggregated", "200/s", "disaggregation overhead @ all at once", "goodput SLO ttft ≤ 1000 ms"} {
		if !strings.Contains(table.String(), want) || !strings.Contains(md.String(), want) {
			t.Errorf("table or Markdown lacks %q:\n%s\n%s", want, table.String(), md.String())
		}
	}
	if !strings.Contains(md.String(), "| ttft_ms p99 |") || !strings.Contains(md.String(), "http_5xx") {
		t.Errorf("Markdown lacks the ttft_ms p99 row or the errors:\n%s", md.String())
	}
	if cfg, err := png.DecodeConfig(&img); err != nil || cfg.Width < 1000 {
		t.Errorf("PNG: %v, %+v", err, cfg)
	}
	if !rep.FailedRuns() {
		t.Error("a sweep with failed requests is not failed")
	}
}

// TestReportSchemaRejects: the schema catches a report that lost a field,
// carries an unknown one or has a wrong value.
func TestReportSchemaRejects(t *testing.T) {
	sch := compileSchema(t)
	rep := sweepReport(t)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	run := func(m map[string]any) map[string]any { return m["runs"].([]any)[0].(map[string]any) }
	for _, tc := range []struct {
		name   string
		mutate func(m map[string]any)
	}{
		{"no runs", func(m map[string]any) { delete(m, "runs") }},
		{"unknown field", func(m map[string]any) { m["speed"] = "fast" }},
		{"no ttft", func(m map[string]any) { delete(run(m), "ttft_ms") }},
		{"negative throughput", func(m map[string]any) { run(m)["output_throughput"] = -1.0 }},
		{"unknown error kind", func(m map[string]any) { run(m)["errors_by_kind"] = map[string]any{"gremlins": 1} }},
		{"share above 1", func(m map[string]any) { run(m)["kv_share_of_ttft"].(map[string]any)["p50"] = 1.5 }},
		{"unknown target", func(m map[string]any) { run(m)["target"].(map[string]any)["name"] = "cloud" }},
		{"unknown length kind", func(m map[string]any) {
			m["config"].(map[string]any)["workload"].(map[string]any)["input_len"].(map[string]any)["kind"] = "zipf"
		}},
		{"goodput a string", func(m map[string]any) { run(m)["goodput"] = "high" }},
		{"report version 2", func(m map[string]any) { m["report_version"] = 2 }},
	} {
		var m map[string]any
		if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		tc.mutate(m)
		b, _ := json.Marshal(m)
		if err := validate(sch, b); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

// TestPairedSweep: a paired sweep has a run per target, validates, and
// says it was paired; it refuses a rate.
func TestPairedSweep(t *testing.T) {
	url := startFake(t, &fakeServer{gap: time.Millisecond})
	o := testOptions(t, url, 4)
	targets := []Target{{Name: TargetDisaggregated, URL: url}, {Name: TargetAggregated, URL: url}}
	rep, err := RunSweep(context.Background(), Sweep{Base: o, Rates: []float64{0}, Targets: targets, Paired: true, Setup: "fake"})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 2 || !rep.Config.Paired || rep.Runs[0].Completed != 4 || rep.Runs[1].Completed != 4 || rep.Runs[1].DurationS <= 0 {
		t.Fatalf("runs %d, paired %v", len(rep.Runs), rep.Config.Paired)
	}
	var buf, table bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := validate(compileSchema(t), buf.Bytes()); err != nil {
		t.Fatalf("the report does not validate: %v", err)
	}
	if d := rep.PairedTTFTDeltaMs; d == nil || d.N != 4 || d.P10 > d.P50 || d.P50 > d.P90 {
		t.Errorf("paired TTFT delta %+v, want 4 ordered pairs", d)
	}
	if err := rep.WriteTable(&table); err != nil || !strings.Contains(table.String(), "overhead @ concurrency 1, paired") ||
		!strings.Contains(table.String(), "request by request (4 pairs)") {
		t.Errorf("table: %v\n%s", err, table.String())
	}
	if _, err := RunSweep(context.Background(), Sweep{Base: o, Rates: []float64{2}, Targets: targets, Paired: true}); err == nil {
		t.Error("a paired sweep at a rate ran")
	}
}

// TestPairedDelta: differences of TTFT matched by conversation and turn,
// over the requests both sides completed, against a hand count.
func TestPairedDelta(t *testing.T) {
	dis := []Record{{Conversation: 0, TTFT: msd(110)}, {Conversation: 1, TTFT: msd(90)}, {Conversation: 2, TTFT: msd(200)},
		{Conversation: 3, TTFT: msd(50), ErrorKind: ErrorEvent}}
	agg := []Record{{Conversation: 2, TTFT: msd(150)}, {Conversation: 0, TTFT: msd(100)}, {Conversation: 1, TTFT: msd(100)},
		{Conversation: 3, TTFT: msd(10)}}
	d := pairedDelta(dis, agg)
	// +10, -10, +50
	if d == nil || d.N != 3 || d.P50 != 10 || d.Mean != 50.0/3 || d.P10 != -6 || d.P90 != 42 {
		t.Errorf("delta %+v, want n 3, p50 10, mean 16.67, p10 -6, p90 42", d)
	}
	if pairedDelta(dis[3:], agg) != nil {
		t.Error("a delta without pairs")
	}
}
