package perfreport

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/summary.golden")

func TestReadReport(t *testing.T) {
	r, err := ReadReport(filepath.Join("testdata", "main.json"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "kvxfer bench --backend tcp,shm --baseline --isl 4096 --json /tmp/br/a.json --md /tmp/br/a.md --model llama-3.1-8b"; r.Command("") != want {
		t.Errorf("Command = %q, want %q", r.Command(""), want)
	}
	if got := (&Report{Args: []string{"a b", "it's", "x"}}).Command("E=1"); got != `E=1 'a b' 'it'\''s' x` {
		t.Errorf("quoting: %s", got)
	}
	if len(r.Runs) != 2 || r.Runs[0].BackendRequested != "tcp" || r.Runs[1].BackendRequested != "shm" {
		t.Fatalf("runs = %+v, want tcp then shm", r.Runs)
	}
	if q, ok := ratio(r.Runs[0], "iperf3"); !ok || q < 0.98 || q > 1 {
		t.Fatalf("tcp vs iperf3 = %v, %v; want the report's 0.99", q, ok)
	}
	bad := filepath.Join(t.TempDir(), "bad.json")
	os.WriteFile(bad, []byte(`{"command": ["x"], "runs": []}`), 0o600)
	for _, p := range []string{bad, filepath.Join(t.TempDir(), "missing.json")} {
		if _, err := ReadReport(p); !errors.Is(err, ErrInput) {
			t.Errorf("ReadReport(%s) = %v, want ErrInput", p, err)
		}
	}
}

func TestReadLayout(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "layout.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := ReadLayout(f)
	if err != nil {
		t.Fatal(err)
	}
	want := []LayoutCase{
		{Name: "BenchmarkPack/ctxTP2-genTP1/pack", XCopy: 0.8046},
		{Name: "BenchmarkPack/ctxTP1-genTP2/pack-staged", XCopy: 0.5322},
		{Name: "BenchmarkUnpack/identical/unpack", XCopy: 0.8216},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d cases, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i].Name != want[i].Name || got[i].XCopy != want[i].XCopy {
			t.Errorf("case %d = %s %v, want %s %v", i, got[i].Name, got[i].XCopy, want[i].Name, want[i].XCopy)
		}
	}
	if _, err := ReadLayout(strings.NewReader("PASS\n")); !errors.Is(err, ErrInput) {
		t.Errorf("output without benchmarks: %v, want ErrInput", err)
	}
	if _, err := ReadLayout(strings.NewReader("BenchmarkPack/a/pack-2 1 2 ns/op x x-copy\n")); !errors.Is(err, ErrInput) {
		t.Errorf("a bad x-copy figure: %v, want ErrInput", err)
	}
}

// rep builds a one-run report.
func rep(cmd string, runs ...Run) *Report { return &Report{Args: []string{cmd}, Runs: runs} }

func run(be string, conc int, ratios ...Ratio) Run {
	isl := bigISL
	if len(ratios) == 0 {
		isl = smallISL
	}
	return Run{BackendRequested: be, Backend: be, ISL: isl, Concurrency: conc, Ctx: TPPP{1, 1}, Gen: TPPP{1, 1}, GBps: 1, Ratios: ratios}
}

func TestEvaluate(t *testing.T) {
	tp2 := run("tcp", 1, Ratio{"iperf3", 0.86})
	tp2.Ctx.TP = 2
	smallTCP, smallTCP8 := run("tcp", 1), run("tcp", 8)
	smallTCP.P50Ms, smallTCP8.TransfersPerS = 0.1, 12000
	smallSHM, smallSHM8 := run("shm", 1), run("shm", 8)
	smallSHM.P50Ms, smallSHM8.TransfersPerS = 0.2, 9999
	failed := run("ucx", 1, Ratio{"ucx_perftest", 2})
	failed.Errors = 1
	ucxTCP := rep("ucxtcp", run("ucx", 1, Ratio{"ucx_perftest", 0.95}, Ratio{"ucx_c", 0.92}))
	ucxTCP.Baselines = []Baseline{{Name: "ucx_perftest", Description: "ucx_perftest tag_bw, UCX_TLS=tcp"}, {Name: "ucx_c", Description: "a C UCP program, UCX_TLS=tcp"}}
	ins := Inputs{
		Main: rep("main",
			run("tcp", 1, Ratio{"iperf3", 0.9}, Ratio{"iperf3_multi", 0.89}),
			run("shm", 1, Ratio{"copy", 0.5}),
			failed),
		TP2:    rep("tp2", tp2),
		UCXTCP: ucxTCP,
		Small:  rep("small", smallTCP, smallTCP8, smallSHM, smallSHM8),
		Layout: []LayoutCase{{Name: "a", XCopy: 0.9}, {Name: "b", XCopy: 0.79}},
	}
	got := Evaluate(ins)
	want := []struct {
		target string
		met    bool
		cmd    string
	}{
		{"tcp, identical layouts ≥ 0.90× iperf3", true, "main"},
		{"tcp, identical layouts ≥ 0.90× iperf3_multi", false, "main"},
		{"tcp, context TP2 → generation TP1 ≥ 0.85× iperf3", true, "tp2"},
		{"ucx, UCX_TLS=tcp ≥ 0.90× the best of ucx_perftest, ucx_c", true, "UCX_TLS=tcp ucxtcp"},
		{"ucx, UCX's own choice of transports ≥ 0.95× the best of ucx_perftest, ucx_c", false, "main"}, // the only ucx run failed
		{"shm ≥ 0.90× copy", false, "main"},
		{"tcp, one 64 KiB block, one at a time: p50 ≤ 0.100 ms", true, "small"},
		{"tcp, one 64 KiB block, 8 at a time: ≥ 10,000 transfers/s", true, "small"},
		{"shm, one 64 KiB block, one at a time: p50 ≤ 0.100 ms", false, "small"},
		{"shm, one 64 KiB block, 8 at a time: ≥ 10,000 transfers/s", false, "small"},
		{"layout Pack/Unpack, every pairing: ≥ 0.80× copy", false, ""},
	}
	if len(got) != len(want) {
		t.Fatalf("%d results, want %d", len(got), len(want))
	}
	for i, w := range want {
		g := got[i]
		if g.Target != w.target || g.Met != w.met || g.Command != w.cmd {
			t.Errorf("result %d = %q met=%v cmd=%q (%s), want %q met=%v cmd=%q", i, g.Target, g.Met, g.Command, g.Measured, w.target, w.met, w.cmd)
		}
	}
	if m := got[3].Measured; !strings.Contains(m, "0.92× ucx_c") {
		t.Errorf("ucx over tcp: %q, want the ratio to the higher baseline, ucx_c, named", m)
	}
	if m := got[4].Measured; !strings.Contains(m, "no error-free ucx run of 4096 tokens") {
		t.Errorf("a failed run is taken as a figure: %q", m)
	}
	if m := got[10].Measured; !strings.Contains(m, "0.79") || !strings.Contains(m, "b") {
		t.Errorf("layout: %q, want the lowest case named", m)
	}
	// A run of another prompt length does not count.
	ins.Main.Runs[0].ISL = 1024
	if r := Evaluate(ins)[0]; r.Met {
		t.Errorf("a 1024-token run was taken for the 4096-token target: %+v", r)
	}
	ins.Main.Runs[0].ISL = bigISL
	// The ratio to ucx_c alone, when ucx_perftest is missing, but below
	// the target.
	ucxTCP.Runs[0].Ratios = []Ratio{{"ucx_c", 0.85}}
	if r := Evaluate(ins)[3]; r.Met || !strings.Contains(r.Measured, "0.85× ucx_c") {
		t.Errorf("ucx_c alone at 0.85: %+v", r)
	}
	// A UCX baseline that ran with other transports is no baseline for
	// UCX_TLS=tcp, whichever of the two it is.
	for i := range ucxTCP.Baselines {
		d := ucxTCP.Baselines[i].Description
		ucxTCP.Baselines[i].Description = "UCX_TLS unset (UCX chooses)"
		if r := Evaluate(ins)[3]; r.Met || !strings.Contains(r.Measured, "did not run with UCX_TLS=tcp") || !strings.Contains(r.Measured, ucxTCP.Baselines[i].Name) {
			t.Errorf("a %s from another UCX_TLS was taken: %+v", ucxTCP.Baselines[i].Name, r)
		}
		ucxTCP.Baselines[i].Description = d
	}
	// Nothing at all: every target is reported, none met.
	for _, r := range Evaluate(Inputs{}) {
		if r.Met || r.Measured == "" {
			t.Errorf("empty inputs: %+v", r)
		}
	}
}

func TestRenderGolden(t *testing.T) {
	main, err := ReadReport(filepath.Join("testdata", "main.json"))
	if err != nil {
		t.Fatal(err)
	}
	ins := Inputs{Main: main, Layout: []LayoutCase{{Name: "BenchmarkPack/x/pack", XCopy: 0.81}}, LayoutCommand: "go test -bench . ./layout/"}
	got := Render(ins, Evaluate(ins))
	golden := filepath.Join("testdata", "summary.golden")
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("Render differs from %s (go test -run RenderGolden -update rewrites it):\n%s", golden, got)
	}
}

func TestSplice(t *testing.T) {
	doc := "# T\n\nbefore\n" + BeginMarker + "\nold 1\nold 2\n" + EndMarker + "\nafter\n"
	out, err := Splice([]byte(doc), "new")
	if err != nil {
		t.Fatal(err)
	}
	want := "# T\n\nbefore\n" + BeginMarker + "\nnew\n" + EndMarker + "\nafter\n"
	if string(out) != want {
		t.Fatalf("Splice =\n%s\nwant\n%s", out, want)
	}
	again, err := Splice(out, "new")
	if err != nil || string(again) != want {
		t.Fatalf("Splice is not idempotent: %v\n%s", err, again)
	}
	for name, bad := range map[string]string{
		"no markers":     "# T\n",
		"no end":         BeginMarker + "\n",
		"reversed":       EndMarker + "\n" + BeginMarker + "\n",
		"begin twice":    BeginMarker + "\n" + BeginMarker + "\n" + EndMarker + "\n",
		"end twice":      BeginMarker + "\n" + EndMarker + "\n" + EndMarker + "\n",
		"marker in text": "see " + BeginMarker + " here\n" + EndMarker + "\n",
	} {
		if _, err := Splice([]byte(bad), "x"); !errors.Is(err, ErrInput) {
			t.Errorf("%s: %v, want ErrInput", name, err)
		}
	}
}

// TestSpliceSection: another section's markers (make bench-reuse's) work
// the same way.
func TestSpliceSection(t *testing.T) {
	b, e := "<!-- other:begin -->", "<!-- other:end -->"
	doc := "# t\n" + b + "\nold\n" + e + "\ntail\n"
	got, err := SpliceSection([]byte(doc), b, e, "new")
	if want := "# t\n" + b + "\nnew\n" + e + "\ntail\n"; err != nil || string(got) != want {
		t.Fatalf("SpliceSection = %q, %v; want %q", got, err, want)
	}
	for _, bad := range []string{"# t\n", b + "\n" + b + "\n" + e + "\n", e + "\n" + b + "\n", b + "\n"} {
		if _, err := SpliceSection([]byte(bad), b, e, "x"); !errors.Is(err, ErrInput) {
			t.Errorf("%q: err %v, want ErrInput", bad, err)
		}
	}
}

// TestEvaluateRounds: a report of several rounds is judged on the median
// of the per-round ratios, for every ratio target alike, whether it is
// below or above the best round over the best round; a report of version
// 2 without the medians has no figure.
func TestEvaluateRounds(t *testing.T) {
	js := `{"report_version": 2, "command": ["kvxfer", "bench"], "config": {"rounds": 3},
	  "baselines": [{"name": "iperf3", "gbps": 4, "best": "-l 1M", "rounds": [{"gbps": 3.5}, {"gbps": 4}, {"gbps": 3.8}]}],
	  "runs": [{"backend_requested": "tcp", "backend": "tcp", "isl": 4096, "concurrency": 1, "ctx": {"tp": 1, "pp": 1}, "gen": {"tp": 1, "pp": 1},
	    "gbps": 3.8, "ratios": [{"baseline": "iperf3", "ratio": 0.95}, {"baseline": "iperf3_multi", "ratio": 0.85}],
	    "median_round_ratios": [{"baseline": "iperf3", "ratio": 0.85}, {"baseline": "iperf3_multi", "ratio": 0.95}],
	    "rounds": [{"gbps": 3.8}, {"gbps": 3.4}, {"gbps": 3.3}]}]}`
	path := filepath.Join(t.TempDir(), "r.json")
	if err := os.WriteFile(path, []byte(js), 0o600); err != nil {
		t.Fatal(err)
	}
	main, err := ReadReport(path)
	if err != nil {
		t.Fatal(err)
	}
	if main.rounds() != 3 || len(main.Runs[0].MedianRoundRatios) != 2 || len(main.Baselines[0].Rounds) != 3 {
		t.Fatalf("read %+v", main)
	}
	got := Evaluate(Inputs{Main: main})
	for i, want := range []struct {
		met      bool
		measured string
	}{
		{false, "3.80 GB/s = 0.85× (median of 3 rounds' ratios; best round over best round 0.95×)"},
		{true, "3.80 GB/s = 0.95× (median of 3 rounds' ratios; best round over best round 0.85×)"},
	} {
		if got[i].Met != want.met || got[i].Measured != want.measured {
			t.Errorf("target %d (%s): met %v %q, want %v %q", i, got[i].Target, got[i].Met, got[i].Measured, want.met, want.measured)
		}
	}
	out := Render(Inputs{Main: main}, got)
	for _, w := range []string{"the best of 3 rounds, the baselines and kvxfer alternating round by round", "median of the 3 per-round ratios",
		"| identical layouts | iperf3 | 4.00 | -l 1M; GB/s by round 3.50 / 4.00 / 3.80 |"} {
		if !strings.Contains(out, w) {
			t.Errorf("the summary lacks %q:\n%s", w, out)
		}
	}
	main.Runs[0].MedianRoundRatios = nil
	if r := Evaluate(Inputs{Main: main})[0]; r.Met || !strings.Contains(r.Measured, "no median of the per-round ratios to iperf3") {
		t.Errorf("a version 2 report without medians: %+v", r)
	}
}
