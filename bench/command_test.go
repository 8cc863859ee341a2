package bench_test

import (
	"bytes"
	"context"
	"encoding/json"
	"image"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/internal/cli"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/santhosh-tekuri/jsonschema/v6"
)

// The report schema is checked with santhosh-tekuri/jsonschema, a complete
// draft 2020-12 implementation: it also checks the schema itself against
// the meta-schema, which a validator of our own would not.
func compileSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(bench.ReportSchema()))
	if err != nil {
		t.Fatal(err)
	}
	const id = "https://github.com/kvxfer/kvxfer/bench/report.schema.json"
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	if err := c.AddResource(id, doc); err != nil {
		t.Fatal(err)
	}
	sch, err := c.Compile(id)
	if err != nil {
		t.Fatalf("the schema does not compile: %v", err)
	}
	return sch
}

func validate(sch *jsonschema.Schema, data []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return err
	}
	return sch.Validate(v)
}

// TestBenchCommand runs `kvxfer bench` as a user would, with a sweep over
// two ISLs and three backends, one of which (ucx) this binary lacks, and
// checks every output: the table, the exit status, the JSON report against
// the schema, the Markdown and the chart.
func TestBenchCommand(t *testing.T) {
	if s, err := transport.Lookup("ucx"); err == nil && s.Available() {
		t.Skip("ucx is built in: no unavailable backend to test")
	}
	// bench starts this test binary as its context process (see TestMain).
	t.Setenv("KVXFER_BENCH_PEER", "1")
	dir := t.TempDir()
	jsonPath, mdPath, pngPath := filepath.Join(dir, "r.json"), filepath.Join(dir, "r.md"), filepath.Join(dir, "r.png")
	var stdout, stderr bytes.Buffer
	code := cli.Run(context.Background(), []string{"bench", "--model", "tiny", "--isl", "64,256", "--backend", "tcp,ucx,auto",
		"--requests", "2", "--warmup", "1", "--verify", "--baseline", "--baseline-bytes", "4194304",
		"--json", jsonPath, "--md", mdPath, "--png", pngPath}, &stdout, &stderr)

	// The two ucx runs fail, naming why; the other four complete.
	if code != 1 {
		t.Errorf("exit status %d, want 1\n%s\n%s", code, stdout.String(), stderr.String())
	}
	if !strings.Contains(stderr.String(), "error: ucx isl=64 c=1 bf16: bench: backend ucx:") ||
		!strings.Contains(stderr.String(), "not built in this binary") {
		t.Errorf("stderr does not name the ucx failure:\n%s", stderr.String())
	}
	var rows int
	for line := range strings.Lines(stdout.String()) {
		if f := strings.Fields(line); len(f) > 3 && (f[0] == "tcp" || f[0] == "auto" || f[0] == "ucx") {
			rows++
		}
	}
	if rows != 6 {
		t.Errorf("%d rows in the table, want 6:\n%s", rows, stdout.String())
	}

	data, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	sch := compileSchema(t)
	if err := validate(sch, data); err != nil {
		t.Fatalf("the report does not validate: %v", err)
	}
	var rep bench.Report
	if err := json.Unmarshal(data, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 6 || len(rep.Baselines) != 4 || rep.Build.GoVersion == "" || rep.Machine.CPUs < 1 {
		t.Fatalf("%d runs, %d baselines, build %+v, machine %+v", len(rep.Runs), len(rep.Baselines), rep.Build, rep.Machine)
	}
	if strings.Join(rep.Command, " ") == "" || rep.Command[0] != "kvxfer" || !strings.Contains(strings.Join(rep.Command, " "), "--isl 64,256") {
		t.Errorf("command %q", rep.Command)
	}
	for _, r := range rep.Runs {
		switch r.RequestedBackend {
		case "ucx":
			if r.Error == "" || r.Errors != 1 || r.Requests != 0 || r.Verification != bench.VerifyNotRun {
				t.Errorf("ucx run: %+v", r)
			}
		default:
			if !r.OK() || r.Verification != bench.VerifyPassed || r.GBps <= 0 || r.Backend == "" || len(r.Ratios) == 0 {
				t.Errorf("%s run: %+v", r.RequestedBackend, r)
			}
		}
	}

	md, err := os.ReadFile(mdPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"kvxfer bench --backend tcp,ucx,auto --baseline --baseline-bytes 4194304 --isl 64,256",
		"| CPU |", "| OS/arch |", "| Go |", "## Baselines", "| raw_tcp |",
		"| backend | carried by | ISL | concurrency | dtype | bytes/request | GB/s | transfers/s | p50 ms | p99 ms |",
		"| tcp | tcp | 64 | 1 | bf16 | 128 KiB |", "| auto | shm | 256 |", "| ucx | – | 256 |", "## Errors",
	} {
		if !strings.Contains(string(md), want) {
			t.Errorf("the Markdown lacks %q:\n%s", want, md)
		}
	}

	f, err := os.Open(pngPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("the chart does not decode: %v", err)
	}
	if st.Size() < 20<<10 || img.Bounds().Dx() < 800 || img.Bounds().Dy() < 400 {
		t.Errorf("chart of %d bytes, %v", st.Size(), img.Bounds())
	}
	if n := distinctColors(img); n < 16 {
		t.Errorf("chart has %d distinct colours: a blank image?", n)
	}
}

func distinctColors(img image.Image) int {
	seen := map[[4]uint32]bool{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y += 2 {
		for x := b.Min.X; x < b.Max.X; x += 2 {
			r, g, bl, a := img.At(x, y).RGBA()
			seen[[4]uint32{r, g, bl, a}] = true
		}
	}
	return len(seen)
}

// TestReportSchemaRejects: the schema is strict enough to catch a report
// that lost a field, carries an unknown one or has a wrong value.
func TestReportSchemaRejects(t *testing.T) {
	sch := compileSchema(t)
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
	if err := validate(sch, buf.Bytes()); err != nil {
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

func run(m map[string]any) map[string]any { return m["runs"].([]any)[0].(map[string]any) }

func TestPrintSchema(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := cli.Run(context.Background(), []string{"bench", "--print-schema"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if stdout.String() != bench.ReportSchema() || !json.Valid(stdout.Bytes()) {
		t.Errorf("printed schema differs from the embedded one")
	}
}
