package bench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transport"
	"gonum.org/v1/plot"
)

// TestSweepTwoByTwo: two ISLs by two backends are four runs, each with its
// own context process, all verified, each over the backend it asked for.
func TestSweepTwoByTwo(t *testing.T) {
	var events []Event
	s := Sweep{
		Base:     peerCfg(Config{Model: "tiny", Requests: 2, Warmup: 1, Verify: true}),
		Backends: []string{"tcp", "shm"},
		ISLs:     []int{64, 200},
		Progress: func(e Event) { events = append(events, e) },
	}
	rep, err := RunSweep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 4 || rep.Failed() || rep.Errors != 0 {
		t.Fatalf("%d runs, failed %v, %d errors", len(rep.Runs), rep.Failed(), rep.Errors)
	}
	want := []struct {
		backend string
		isl     int
	}{{"tcp", 64}, {"tcp", 200}, {"shm", 64}, {"shm", 200}}
	for i, r := range rep.Runs {
		if r.RequestedBackend != want[i].backend || r.Backend != want[i].backend || r.ISL != want[i].isl {
			t.Errorf("run %d: asked %s isl %d, used %q: want %+v", i, r.RequestedBackend, r.ISL, r.Backend, want[i])
		}
		if r.Verification != VerifyPassed || !r.Verified || r.Requests != 2 || r.GBps <= 0 || r.P99Ms < r.P50Ms {
			t.Errorf("run %d: %+v", i, r)
		}
		if wantBytes := int64(layoutBlocks(r.ISL)) * 32 * 2048; r.BytesPerReq != wantBytes {
			t.Errorf("run %d: %d bytes per request, want %d", i, r.BytesPerReq, wantBytes)
		}
	}
	var starts, dones int
	for _, e := range events {
		switch e.Phase {
		case PhaseStart:
			starts++
		case PhaseDone:
			dones++
			if e.Runs != 4 || e.Result == nil {
				t.Errorf("done event %+v", e)
			}
		}
	}
	if starts != 4 || dones != 4 {
		t.Errorf("%d start and %d done events, want 4 each", starts, dones)
	}
	if len(rep.Baselines) != 0 {
		t.Errorf("baselines without Baseline: %+v", rep.Baselines)
	}
}

func layoutBlocks(isl int) int { return (isl + 31) / 32 }

// TestSweepConfigErrors: every problem with a sweep is reported at once,
// before anything runs.
func TestSweepConfigErrors(t *testing.T) {
	_, err := RunSweep(context.Background(), Sweep{Base: Config{Model: "gpt-5"}, Backends: []string{"tcp", "carrier-pigeon"},
		DTypes: []string{"bf16", "fp4"}})
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{"gpt-5", "carrier-pigeon", "fp4"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
}

// fakeIperf3 writes an iperf3 that serves (sleeps briefly) with -s and
// prints the canned JSON report with -c: 2.5 GB/s received with -l 128K,
// with -l 1M 3.75 GB/s on its odd-numbered runs and 5 on its
// even-numbered ones (a baseline that takes one run per length would
// read 3.75), and a refusal of -l 4M as iperf3 3.12 answers.
func fakeIperf3(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	canned, err := filepath.Abs(filepath.Join("testdata", "iperf3.json"))
	if err != nil {
		t.Fatal(err)
	}
	script := "#!/bin/sh\ncase \"$*\" in\n-s*) sleep 0.2 ;;\n" +
		"*'-l 4M'*) echo 'iperf3: parameter error - block size too large (maximum = 1048576 bytes)' >&2; exit 1 ;;\n" +
		"*'-l 1M'*) n=$(cat '" + dir + "/n1M' 2>/dev/null || echo 0); echo $((n+1)) > '" + dir + "/n1M'\n" +
		"  if [ $((n % 2)) = 0 ]; then sed 's/20000000000/30000000000/' '" + canned + "'; else sed 's/20000000000/40000000000/' '" + canned + "'; fi ;;\n" +
		"*) cat '" + canned + "' ;;\nesac\n"
	exe := filepath.Join(dir, "iperf3")
	if err := os.WriteFile(exe, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return exe
}

// TestSweepBaselines: the baselines are measured (copy and raw TCP here;
// iperf3 from a stand-in printing a real report), a tool that is not
// installed is skipped with a note, and each run gets its ratio to the
// baselines of the backend that carried it.
func TestSweepBaselines(t *testing.T) {
	iperf3 := fakeIperf3(t)
	s := Sweep{
		Base:          peerCfg(Config{Model: "tiny", Requests: 2, Warmup: 1}),
		Backends:      []string{"tcp", "shm"},
		ISLs:          []int{128},
		Baseline:      true,
		BaselineBytes: 4 << 20,
		lookPath: func(name string) (string, error) {
			if name == "iperf3" {
				return iperf3, nil
			}
			return "", exec.ErrNotFound
		},
	}
	rep, err := RunSweep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Baseline{}
	for _, b := range rep.Baselines {
		got[b.Name] = b
	}
	if b := got[BaselineCopy]; b.GBps <= 0 || b.Bytes != 4<<20 || len(b.Backends) != 1 || b.Backends[0] != "shm" {
		t.Errorf("copy: %+v", b)
	}
	if b := got[BaselineRawTCP]; b.GBps <= 0 || b.Error != "" {
		t.Errorf("raw TCP: %+v", b)
	}
	for _, name := range []string{BaselineIperf3, BaselineIperf3Multi} {
		b := got[name]
		if math.Abs(b.GBps-5) > 1e-9 || b.Best != "-l 1M" || !strings.Contains(b.Command, "-n 4194304 -l 1M") || b.Error != "" {
			t.Errorf("%s: %+v, want 5 GB/s (40e9 bits/s received) from -l 1M", name, b)
		}
		if len(b.Variants) != 3 || b.Variants[0].GBps != 2.5 || b.Variants[2].GBps != 0 || !strings.Contains(b.Variants[2].Error, "block size too large") {
			t.Errorf("%s: variants %+v, want 128K at 2.5, 1M at 5, 4M refused", name, b.Variants)
		}
		if multi := strings.Contains(b.Command, fmt.Sprintf("-P %d", transport.DefaultStreams)); multi != (name == BaselineIperf3Multi) {
			t.Errorf("%s: command %q", name, b.Command)
		}
	}
	for _, name := range []string{BaselineCopy, BaselineCopy2} {
		b := got[name]
		if len(b.Variants) != 2 || b.Variants[0].GBps <= 0 || b.Variants[1].GBps <= 0 || b.GBps != max(b.Variants[0].GBps, b.Variants[1].GBps) {
			t.Errorf("%s: %+v, want the best of Go's copy and memcpy", name, b)
		}
	}
	for _, name := range []string{BaselineUCXPerftest, BaselineUCXC} {
		if b, ok := got[name]; ok {
			t.Errorf("%s measured for a sweep without backend ucx: %+v", name, b)
		}
	}
	if rep.Failed() {
		t.Fatalf("%+v", rep.Runs)
	}
	for _, r := range rep.Runs {
		var names []string
		for _, ra := range r.Ratios {
			names = append(names, ra.Baseline)
			if ra.Ratio <= 0 {
				t.Errorf("%s: ratio %+v", r.Label(), ra)
			}
		}
		want := map[string]string{"tcp": "raw_tcp,iperf3,iperf3_multi", "shm": "copy,copy_2threads"}[r.Backend]
		if strings.Join(names, ",") != want {
			t.Errorf("%s over %s: ratios to %v, want %s", r.Label(), r.Backend, names, want)
		}
	}
}

// TestUCXPerftestBaseline runs the real ucx_perftest where it is installed.
func TestUCXPerftestBaseline(t *testing.T) {
	if _, err := exec.LookPath("ucx_perftest"); err != nil {
		t.Skip("ucx_perftest is not installed")
	}
	br := &baselineRunner{bytes: 32 << 20, lookPath: exec.LookPath, timeout: time.Minute}
	b := br.ucxPerftest(context.Background())
	if b.GBps <= 0 || b.Error != "" || len(b.Variants) != 2 {
		t.Fatalf("%+v", b)
	}
	for _, v := range b.Variants {
		if v.GBps <= 0 || v.Bytes != 8*map[string]int64{"-s 16 MiB": 16 << 20, "-s 32 MiB": 32 << 20}[v.Setting] {
			t.Errorf("variant %+v", v)
		}
		if v.Setting == b.Best && (v.Bytes != b.Bytes || v.GBps != b.GBps) {
			t.Errorf("best %q: %+v, baseline %+v", b.Best, v, b)
		}
	}
	t.Logf("%.2f GB/s: %s", b.GBps, b.Command)
}

func TestParseIperf3(t *testing.T) {
	for _, tc := range []struct {
		file, err string
		gbps      float64
	}{
		{"iperf3.json", "", 2.5},
		{"iperf3_error.json", "unable to connect to server", 0},
	} {
		out, err := os.ReadFile(filepath.Join("testdata", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		gbps, err := parseIperf3(out)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: %v, want an error with %q", tc.file, err, tc.err)
			}
			continue
		}
		if err != nil || math.Abs(gbps-tc.gbps) > 1e-9 {
			t.Errorf("%s: %v GB/s, %v; want %v", tc.file, gbps, err, tc.gbps)
		}
	}
	if _, err := parseIperf3([]byte("iperf3: error - the server is busy")); err == nil {
		t.Error("not JSON: accepted")
	}
}

func TestParseUCXPerftest(t *testing.T) {
	for _, tc := range []struct {
		file string
		mbps float64
	}{
		{"ucx_perftest_1.18.txt", 3206.94}, // Final: line with a percentile column
		{"ucx_perftest_1.8.txt", 3325.50},  // older: no label, no percentile
	} {
		out, err := os.ReadFile(filepath.Join("testdata", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		gbps, err := parseUCXPerftest(out)
		if want := tc.mbps * (1 << 20) / 1e9; err != nil || math.Abs(gbps-want) > 1e-9 {
			t.Errorf("%s: %v GB/s, %v; want %v", tc.file, gbps, err, want)
		}
	}
	if _, err := parseUCXPerftest([]byte("connect() failed: Connection refused\n")); err == nil {
		t.Error("no result line: accepted")
	}
}

func TestRatios(t *testing.T) {
	bs := []Baseline{{Name: BaselineCopy, GBps: 10}, {Name: BaselineRawTCP, GBps: 2}, {Name: BaselineIperf3},
		{Name: BaselineUCXPerftest, GBps: 4}, {Name: BaselineUCXC, GBps: 8}}
	for _, tc := range []struct {
		backend string
		gbps    float64
		want    []Ratio
	}{
		{"tcp", 1, []Ratio{{BaselineRawTCP, 0.5}}}, // iperf3 not measured
		{"shm", 5, []Ratio{{BaselineCopy, 0.5}}},
		{"ucx(cma)", 2, []Ratio{{BaselineUCXPerftest, 0.5}, {BaselineUCXC, 0.25}}},
		{"shm+tcp", 2, nil}, // mixed: no single limit applies
		{"", 0, nil},
		{"tcp", 0, nil},
	} {
		got := ratios(&Result{Backend: tc.backend, GBps: tc.gbps}, bs)
		if len(got) != len(tc.want) {
			t.Errorf("%s: %v, want %v", tc.backend, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("%s: %v, want %v", tc.backend, got, tc.want)
			}
		}
	}
}

// TestVerifyLimit: requests larger than the naive reference allows are
// not verified (the run reports VerifySkipped), smaller ones are.
func TestVerifyLimit(t *testing.T) {
	m, _ := LookupModel("llama-3.1-8b")
	st, err := m.State(kvcache.BF16, 32, 1, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	if !verifiable(st, 8192) { // 1 GiB: the limit
		t.Error("8192 tokens (1 GiB) not verifiable")
	}
	if verifiable(st, 16384) {
		t.Error("16384 tokens (2 GiB) verifiable")
	}
}

// TestMemoryGuard: a run that cannot fit is refused before it allocates,
// with what it needs and what there is.
func TestMemoryGuard(t *testing.T) {
	if _, ok := memAvailable(); !ok {
		t.Skip("no /proc/meminfo")
	}
	c := peerCfg(Config{Model: "llama-3.1-70b", ISL: 1 << 20, Concurrency: 64})
	_, err := Run(context.Background(), c)
	if err == nil || !strings.Contains(err.Error(), "this run needs about") || !strings.Contains(err.Error(), "available") {
		t.Fatalf("%v", err)
	}
}

// TestUnavailableBackend: a backend this binary lacks fails its run with
// the reason, before any process starts.
func TestUnavailableBackend(t *testing.T) {
	_, err := Run(context.Background(), peerCfg(Config{Backend: "nixl", ISL: 32, Requests: 1}))
	if err == nil || !strings.Contains(err.Error(), "NIXL is not available") {
		t.Fatalf("%v", err)
	}
}

func TestProgress(t *testing.T) {
	events := []Event{
		{Phase: PhaseBaseline, Baseline: &Baseline{Name: "copy", GBps: 9, Bytes: 1 << 20}},
		{Phase: PhaseBaseline, Baseline: &Baseline{Name: "iperf3", Skipped: "iperf3 is not installed"}},
		{Phase: PhaseStart, Run: 1, Runs: 2, Label: "tcp isl=64", Total: 3},
		{Phase: PhaseWarmup, Run: 1, Runs: 2, Label: "tcp isl=64", Done: 1, Total: 3},
		{Phase: PhaseMeasure, Run: 1, Runs: 2, Label: "tcp isl=64", Done: 3, Total: 3},
		{Phase: PhaseDone, Run: 1, Runs: 2, Label: "tcp isl=64", Result: &Result{GBps: 1.5, Backend: "tcp"}},
		{Phase: PhaseStart, Run: 2, Runs: 2, Label: "ucx isl=64", Total: 3},
		{Phase: PhaseDone, Run: 2, Runs: 2, Label: "ucx isl=64", Result: &Result{Error: "not built\nsecond line"}},
	}
	var term, plain bytes.Buffer
	bar, lines := NewProgress(&term, true), NewProgress(&plain, false)
	for _, e := range events {
		bar(e)
		lines(e)
	}
	if strings.Contains(plain.String(), "\r") || strings.Count(plain.String(), "\n") != 6 {
		t.Errorf("plain progress:\n%s", plain.String())
	}
	for _, want := range []string{"baseline copy: 9.00 GB/s", "skipped: iperf3 is not installed", "run 1/2 tcp isl=64: 1.50 GB/s", "run 2/2 ucx isl=64: failed: not built\n"} {
		if !strings.Contains(plain.String(), want) {
			t.Errorf("plain progress lacks %q:\n%s", want, plain.String())
		}
	}
	out := term.String()
	if !strings.Contains(out, "\r") || !strings.Contains(out, "run 1/2  tcp isl=64  measure 3/3") || !strings.Contains(out, " 50%") {
		t.Errorf("bar:\n%q", out)
	}
	// The last run's line is printed over the bar, and no bar follows it.
	if !strings.Contains(out, "\r\033[Kbench: run 2/2 ucx isl=64: failed") || !strings.HasSuffix(out, "failed: not built\n") {
		t.Errorf("the bar is not cleared at the end: %q", out[max(0, len(out)-80):])
	}
}

func TestHumanBytes(t *testing.T) {
	for n, want := range map[int64]string{512: "512 B", 128 << 10: "128 KiB", 2 << 30: "2 GiB", 3 << 29: "1.5 GiB"} {
		if got := humanBytes(n); got != want {
			t.Errorf("%d: %q, want %q", n, got, want)
		}
	}
}

func TestTicks(t *testing.T) {
	labels := func(ts []plot.Tick) string {
		var out []string
		for _, t := range ts {
			if t.Label != "" {
				out = append(out, t.Label)
			}
		}
		return strings.Join(out, " ")
	}
	for _, tc := range []struct {
		lo, hi float64
		want   string
	}{
		{0, 9.4, "0 2 4 6 8"},
		{0, 1.1, "0.0 0.2 0.4 0.6 0.8 1.0"},
		{0, 0.33, "0.00 0.05 0.10 0.15 0.20 0.25 0.30"},
		{0, 1, "0.0 0.2 0.4 0.6 0.8 1.0"},
	} {
		if got := labels(linearTicks(tc.lo, tc.hi)); got != tc.want {
			t.Errorf("linear %v..%v: %q, want %q", tc.lo, tc.hi, got, tc.want)
		}
	}
	if got := labels(pow2Ticks(1024/math.Sqrt2, 16384*math.Sqrt2)); got != "1K 2K 4K 8K 16K" {
		t.Errorf("pow2: %q", got)
	}
	if got := labels(pow2Ticks(64/math.Sqrt2, 64*math.Sqrt2)); got != "64" {
		t.Errorf("pow2 of one ISL: %q", got)
	}
}
