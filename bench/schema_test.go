package bench_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/bench/benchtest"
)

// TestReportSchemaRejects: the schema is strict enough to catch a report
// that lost a field, carries an unknown one or has a wrong value.
func TestReportSchemaRejects(t *testing.T) {
	sch := benchtest.Schema(t)
	rep := &bench.Report{Version: bench.ReportVersion, Command: []string{"kvxfer", "bench"}, Baselines: []bench.Baseline{},
		Config: bench.SweepConfig{Model: "tiny", Backends: []string{"tcp"}, ISLs: []int{64}, Concurrency: []int{1},
			DTypes: []string{"bf16"}, Requests: 1, Ctx: bench.Par{TP: 1, PP: 1}, Gen: bench.Par{TP: 1, PP: 1},
			TokensPerBlock: 32, BaselineBytes: 1, Env: map[string]string{}},
		Machine: bench.Machine{CPUs: 1, GOOS: "linux", GOARCH: "amd64", GoVersion: "go1.26"},
		Runs: []*bench.Result{{RequestedBackend: "tcp", Model: "tiny", ISL: 64, DType: "bf16", Concurrency: 1,
			Ctx: bench.Par{TP: 1, PP: 1}, Gen: bench.Par{TP: 1, PP: 1}, Backend: "tcp", Verification: bench.VerifyOff}}}
	rep.Build.Module, rep.Build.GoVersion = "github.com/kvxfer/kvxfer", "go1.26"
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	if err := benchtest.Validate(sch, buf.Bytes()); err != nil {
		t.Fatalf("a minimal report does not validate: %v", err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(m map[string]any)
	}{
		{"no runs", func(m map[string]any) { delete(m, "runs") }},
		{"unknown field", func(m map[string]any) { m["speed"] = "fast" }},
		{"negative GB/s", func(m map[string]any) { run(m)["gbps"] = -1.0 }},
		{"unknown verification", func(m map[string]any) { run(m)["verification"] = "maybe" }},
		{"ISL zero", func(m map[string]any) { run(m)["isl"] = 0 }},
		{"unknown baseline in a ratio", func(m map[string]any) {
			run(m)["ratios"] = []any{map[string]any{"baseline": "netcat", "ratio": 1.0}}
		}},
		{"started not a date", func(m map[string]any) { m["started"] = "yesterday" }},
		{"report version 1", func(m map[string]any) { m["report_version"] = 1 }},
	} {
		var m map[string]any
		if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		tc.mutate(m)
		b, _ := json.Marshal(m)
		if err := benchtest.Validate(sch, b); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func run(m map[string]any) map[string]any { return m["runs"].([]any)[0].(map[string]any) }
