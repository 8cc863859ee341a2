package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// round is a fake round of a tcp run: requests of 1 GB at gbps, their
// latencies lat (ms).
func round(gbps float64, lat ...float64) *Result {
	r := &Result{RequestedBackend: "tcp", Model: "tiny", ISL: 64, DType: "bf16", Concurrency: 1, Backend: "tcp",
		Requests: len(lat), Bytes: int64(len(lat)) * 1e9, BytesPerReq: 1e9, GBps: gbps, Verification: VerifyPassed, Verified: true, lat: lat}
	if gbps > 0 {
		r.MeasuredS = float64(r.Bytes) / gbps / 1e9
		r.TransfersPerS = float64(r.Requests) / r.MeasuredS
	}
	r.P50Ms, r.P99Ms = percentile(lat, 50), percentile(lat, 99)
	return r
}

func TestMergeRuns(t *testing.T) {
	failed := round(0)
	failed.fail(errors.New("bench: context side: dead"))
	partial := round(2, 5, 6)
	partial.addError("request 9: timed out")
	shm := round(4, 1, 2)
	shm.Backend = "shm"
	for _, tc := range []struct {
		name          string
		rounds        []*Result
		gbps, xfers   float64
		requests      int
		p50, p99      float64
		backend       string
		errors        int
		err           string   // Error
		msgs          []string // ErrorMessages
		verification  string
		measuredS     float64
		roundFigures  []float64
		roundFailures []bool
	}{
		{name: "one round is the round", rounds: []*Result{round(3, 4, 5, 6)}, gbps: 3, xfers: 3, requests: 3, p50: 5, p99: 6,
			backend: "tcp", verification: VerifyPassed, measuredS: 1, roundFigures: []float64{3}, roundFailures: []bool{false}},
		{name: "best round, pooled latencies", rounds: []*Result{round(2, 10, 20), round(4, 1, 2), round(3, 30, 40)},
			gbps: 4, xfers: 4, requests: 6, p50: 10, p99: 40, backend: "tcp", verification: VerifyPassed, measuredS: 1 + 0.5 + 2.0/3,
			roundFigures: []float64{2, 4, 3}, roundFailures: []bool{false, false, false}},
		{name: "a round that could not start fails the run", rounds: []*Result{round(3, 1, 2), failed},
			gbps: 3, xfers: 3, requests: 2, p50: 1, p99: 2, backend: "tcp", errors: 1, err: "round 2 of 2: bench: context side: dead",
			verification: VerifyFailed, measuredS: 2.0 / 3, roundFigures: []float64{3, 0}, roundFailures: []bool{false, true}},
		{name: "a round's failed transfer fails the run", rounds: []*Result{round(3, 1, 2), partial, round(5, 3, 4)},
			gbps: 5, xfers: 5, requests: 6, p50: 3, p99: 6, backend: "tcp", errors: 1, msgs: []string{"round 2 of 3: request 9: timed out"},
			verification: VerifyPassed, measuredS: 2.0/3 + 1 + 0.4, roundFigures: []float64{3, 2, 5}, roundFailures: []bool{false, false, false}},
		{name: "backends of the rounds joined", rounds: []*Result{round(3, 1, 2), shm}, gbps: 4, xfers: 4, requests: 4, p50: 1, p99: 2,
			backend: "tcp+shm", verification: VerifyPassed, measuredS: 2.0/3 + 0.5, roundFigures: []float64{3, 4}, roundFailures: []bool{false, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := mergeRuns(tc.rounds, len(tc.rounds))
			near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
			if !near(got.GBps, tc.gbps) || !near(got.TransfersPerS, tc.xfers) || got.Requests != tc.requests || !near(got.MeasuredS, tc.measuredS) {
				t.Errorf("figures %.3f GB/s %.3f/s, %d requests in %.3f s; want %.3f, %.3f, %d, %.3f",
					got.GBps, got.TransfersPerS, got.Requests, got.MeasuredS, tc.gbps, tc.xfers, tc.requests, tc.measuredS)
			}
			if got.P50Ms != tc.p50 || got.P99Ms != tc.p99 {
				t.Errorf("p50 %v p99 %v, want %v %v", got.P50Ms, got.P99Ms, tc.p50, tc.p99)
			}
			if got.Backend != tc.backend || got.Errors != tc.errors || got.Error != tc.err || !slices.Equal(got.ErrorMessages, tc.msgs) {
				t.Errorf("backend %q, %d errors, %q, %q; want %q, %d, %q, %q", got.Backend, got.Errors, got.Error, got.ErrorMessages,
					tc.backend, tc.errors, tc.err, tc.msgs)
			}
			if got.Verification != tc.verification || got.Verified != (tc.verification == VerifyPassed && tc.errors == 0) {
				t.Errorf("verification %q verified %v, want %q", got.Verification, got.Verified, tc.verification)
			}
			if got.OK() != (tc.errors == 0) {
				t.Errorf("OK() = %v with %d errors", got.OK(), tc.errors)
			}
			if got.Bytes != int64(tc.requests)*1e9 {
				t.Errorf("bytes %d, want the sum of the rounds'", got.Bytes)
			}
			if len(got.Rounds) != len(tc.roundFigures) {
				t.Fatalf("%d rounds, want %d", len(got.Rounds), len(tc.roundFigures))
			}
			for k, rr := range got.Rounds {
				if rr.GBps != tc.roundFigures[k] || (rr.Error != "") != tc.roundFailures[k] {
					t.Errorf("round %d: %+v, want %.1f GB/s, failed %v", k+1, rr, tc.roundFigures[k], tc.roundFailures[k])
				}
			}
		})
	}
}

// TestMergeRunsLatencyProperty: the pooled percentiles are those of every
// round's requests put together, whatever the rounds.
func TestMergeRunsLatencyProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		var rs []*Result
		var all []float64
		for range 2 + rng.IntN(4) {
			lat := make([]float64, 1+rng.IntN(20))
			for i := range lat {
				lat[i] = rng.Float64() * 100
			}
			all = append(all, lat...)
			rs = append(rs, round(1+rng.Float64()*5, lat...))
		}
		got := mergeRuns(rs, len(rs))
		slices.Sort(all)
		// The naive percentile: the value below which p% of the
		// requests lie, counted by hand.
		for _, p := range []float64{50, 99} {
			want := all[max(0, min(len(all)-1, int(math.Round(p/100*float64(len(all))))-1))]
			g := map[float64]float64{50: got.P50Ms, 99: got.P99Ms}[p]
			if g != want {
				t.Fatalf("p%.0f of %d pooled requests = %v, want %v", p, len(all), g, want)
			}
		}
		best := 0.0
		for _, r := range rs {
			best = max(best, r.GBps)
		}
		if got.GBps != best {
			t.Fatalf("GB/s %v, want the best round's %v", got.GBps, best)
		}
	}
}

func TestMergeBaselines(t *testing.T) {
	iperf := func(gbps float64, variants int) Baseline {
		b := Baseline{Name: BaselineIperf3, Description: "iperf3", GBps: gbps, Best: "-l 1M"}
		for range variants {
			b.Variants = append(b.Variants, Variant{Setting: "-l 1M", GBps: gbps})
		}
		return b
	}
	failed := Baseline{Name: BaselineIperf3, Description: "iperf3", Error: "iperf3: connection refused"}
	skipped := Baseline{Name: BaselineUCXPerftest, Description: "ucx_perftest", Skipped: "not installed"}
	copyB := Baseline{Name: BaselineCopy, Description: "copy", GBps: 10}
	for _, tc := range []struct {
		name   string
		rounds [][]Baseline
		want   []Baseline
	}{
		{"one round", [][]Baseline{{iperf(3, 1)}},
			[]Baseline{{Name: BaselineIperf3, Description: "iperf3", GBps: 3, Best: "-l 1M", Variants: []Variant{{Setting: "-l 1M", GBps: 3}},
				Rounds: []BaselineRound{{GBps: 3}}}}},
		{"the best of three rounds", [][]Baseline{{iperf(3, 3), copyB}, {iperf(5, 1), copyB}, {iperf(4, 1), {Name: BaselineCopy, GBps: 12}}},
			[]Baseline{
				{Name: BaselineIperf3, Description: "iperf3; best of 3 rounds (every setting tried in every round)", GBps: 5,
					Best: "-l 1M", Variants: iperf(5, 1).Variants, Rounds: []BaselineRound{{GBps: 3}, {GBps: 5}, {GBps: 4}}},
				{Name: BaselineCopy, Description: "copy; best of 3 rounds", GBps: 12, Rounds: []BaselineRound{{GBps: 10}, {GBps: 10}, {GBps: 12}}},
			}},
		{"a failed round leaves no figure", [][]Baseline{{iperf(3, 1)}, {failed}, {iperf(4, 1)}},
			[]Baseline{{Name: BaselineIperf3, Description: "iperf3", Best: "-l 1M", Variants: iperf(4, 1).Variants,
				Error:  "round 2 of 3: iperf3: connection refused",
				Rounds: []BaselineRound{{GBps: 3}, {Error: "iperf3: connection refused"}, {GBps: 4}}}}},
		{"a round that lacks it", [][]Baseline{{iperf(3, 1), copyB}, {copyB}},
			[]Baseline{
				{Name: BaselineIperf3, Description: "iperf3", Best: "-l 1M", Variants: iperf(3, 1).Variants,
					Error: "round 2 of 2: not measured in this round", Rounds: []BaselineRound{{GBps: 3}, {Error: "not measured in this round"}}},
				{Name: BaselineCopy, Description: "copy; best of 2 rounds", GBps: 10, Rounds: []BaselineRound{{GBps: 10}, {GBps: 10}}},
			}},
		{"skipped and failed first rounds are not measured again", [][]Baseline{{skipped, failed}, {}},
			[]Baseline{skipped, {Name: BaselineIperf3, Description: "iperf3", Error: "round 1 of 2: iperf3: connection refused",
				Rounds: []BaselineRound{{Error: "iperf3: connection refused"}}}}},
		{"no rounds", nil, []Baseline{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := mergeBaselines(tc.rounds)
			if got == nil || fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", tc.want) {
				t.Errorf("got\n%+v\nwant\n%+v", got, tc.want)
			}
		})
	}
}

// TestRoundRatios: best over best, and the median of the per-round
// ratios, which pairs each round's run with the same round's baseline.
func TestRoundRatios(t *testing.T) {
	bl := func(name string, gbps ...float64) Baseline {
		b := Baseline{Name: name}
		for _, g := range gbps {
			b.Rounds = append(b.Rounds, BaselineRound{GBps: g})
			b.GBps = max(b.GBps, g)
		}
		return b
	}
	for _, tc := range []struct {
		name     string
		run      []float64 // the run's GB/s by round
		bs       []Baseline
		best     []Ratio
		medians  []Ratio
		perRound [][]Ratio
	}{
		{"one round", []float64{2}, []Baseline{bl(BaselineIperf3, 4)},
			[]Ratio{{BaselineIperf3, 0.5}}, []Ratio{{BaselineIperf3, 0.5}}, [][]Ratio{{{BaselineIperf3, 0.5}}}},
		// Best over best is 4/8 = 0.5; round by round 2/2, 4/8, 3/4:
		// the median, 0.75, is not the ratio of the medians.
		{"three rounds", []float64{2, 4, 3}, []Baseline{bl(BaselineRawTCP, 2, 8, 4), bl(BaselineIperf3, 4, 4, 4)},
			[]Ratio{{BaselineRawTCP, 0.5}, {BaselineIperf3, 1}}, []Ratio{{BaselineRawTCP, 0.75}, {BaselineIperf3, 0.75}},
			[][]Ratio{{{BaselineRawTCP, 1}, {BaselineIperf3, 0.5}}, {{BaselineRawTCP, 0.5}, {BaselineIperf3, 1}}, {{BaselineRawTCP, 0.75}, {BaselineIperf3, 0.75}}}},
		{"an even number of rounds: the mean of the middle two", []float64{1, 2, 3, 4}, []Baseline{bl(BaselineIperf3, 4, 4, 4, 4)},
			[]Ratio{{BaselineIperf3, 1}}, []Ratio{{BaselineIperf3, 0.625}},
			[][]Ratio{{{BaselineIperf3, 0.25}}, {{BaselineIperf3, 0.5}}, {{BaselineIperf3, 0.75}}, {{BaselineIperf3, 1}}}},
		{"a baseline without a figure gets no ratio", []float64{2, 2}, []Baseline{{Name: BaselineIperf3, Error: "round 2 of 2: refused",
			Rounds: []BaselineRound{{GBps: 4}, {Error: "refused"}}}}, nil, nil, [][]Ratio{nil, nil}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rs []*Result
			for _, g := range tc.run {
				rs = append(rs, round(g, 1))
			}
			run := mergeRuns(rs, len(rs))
			best := ratios(run, tc.bs)
			medians := roundRatios(run, tc.bs)
			if !ratiosNear(best, tc.best) || !ratiosNear(medians, tc.medians) {
				t.Errorf("best/best %v, medians %v; want %v, %v", best, medians, tc.best, tc.medians)
			}
			for k, rr := range run.Rounds {
				if !ratiosNear(rr.Ratios, tc.perRound[k]) {
					t.Errorf("round %d: %v, want %v", k+1, rr.Ratios, tc.perRound[k])
				}
			}
		})
	}
}

func ratiosNear(a, b []Ratio) bool {
	return slices.EqualFunc(a, b, func(x, y Ratio) bool { return x.Baseline == y.Baseline && math.Abs(x.Ratio-y.Ratio) < 1e-9 })
}

// TestMedianProperty checks median against a naive reference: the value
// with as many at or below it as at or above it, counted by hand.
func TestMedianProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for range 500 {
		xs := make([]float64, 1+rng.IntN(9))
		for i := range xs {
			xs[i] = float64(rng.IntN(6)) // ties included
		}
		orig := slices.Clone(xs)
		m := median(xs)
		if !slices.Equal(xs, orig) {
			t.Fatal("median reordered its argument")
		}
		// The k-th smallest, by counting.
		kth := func(k int) float64 {
			for _, x := range xs {
				below, equal := 0, 0
				for _, y := range xs {
					if y < x {
						below++
					} else if y == x {
						equal++
					}
				}
				if below <= k && k < below+equal {
					return x
				}
			}
			t.Fatalf("no %d-th of %v", k, xs)
			return 0
		}
		n := len(xs)
		want := kth(n / 2)
		if n%2 == 0 {
			want = (kth(n/2-1) + kth(n/2)) / 2
		}
		if m != want {
			t.Fatalf("median(%v) = %v, want %v", xs, m, want)
		}
	}
	if median(nil) != 0 {
		t.Error("median of nothing")
	}
}

// TestSweepRoundsAlternate: with fake measurements, a sweep of three
// rounds measures the baselines, then each run, round after round; a run
// that fails in a round is not made again and its row keeps the error;
// the rows and ratios are the best of the rounds and the median of the
// per-round ratios.
func TestSweepRoundsAlternate(t *testing.T) {
	var calls []string
	runGBps := map[int][]float64{64: {2, 3, 2.5}, 128: {1, 1}, 256: {}} // by ISL, by round
	baseGBps := []float64{4, 5, 2}
	tried := map[int]int{}
	s := Sweep{
		Base:     Config{Model: "tiny", Requests: 2, Warmup: 1},
		ISLs:     []int{64, 128, 256},
		Baseline: true,
		Rounds:   3,
		measureBaselines: func(_ context.Context, k int) []Baseline {
			calls = append(calls, fmt.Sprintf("baselines %d", k+1))
			return []Baseline{{Name: BaselineIperf3, GBps: baseGBps[k], Best: "-l 1M"}}
		},
		run: func(_ context.Context, c Config) (*Result, error) {
			k := tried[c.ISL]
			tried[c.ISL]++
			calls = append(calls, fmt.Sprintf("run isl=%d round %d", c.ISL, k+1))
			if c.ISL == 128 && k == 1 {
				return nil, errors.New("bench: context side: dead")
			}
			if c.ISL == 256 {
				return nil, errors.New("bench: backend tcp: refused")
			}
			r := round(runGBps[c.ISL][k], float64(10*(k+1)), float64(10*(k+1)+1))
			r.ISL = c.ISL
			return r, nil
		},
	}
	var events []Event
	s.Progress = func(e Event) { events = append(events, e) }
	rep, err := RunSweep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"baselines 1", "run isl=64 round 1", "run isl=128 round 1", "run isl=256 round 1",
		"baselines 2", "run isl=64 round 2", "run isl=128 round 2", // isl=256 failed in round 1
		"baselines 3", "run isl=64 round 3", // isl=128 failed in round 2
	}
	if !slices.Equal(calls, want) {
		t.Fatalf("calls:\n%s\nwant:\n%s", strings.Join(calls, "\n"), strings.Join(want, "\n"))
	}
	if rep.Config.Rounds != 3 || len(rep.Baselines) != 1 || len(rep.Runs) != 3 {
		t.Fatalf("config %+v, %d baselines, %d runs", rep.Config, len(rep.Baselines), len(rep.Runs))
	}
	if b := rep.Baselines[0]; b.GBps != 5 || len(b.Rounds) != 3 {
		t.Errorf("baseline %+v, want the best of 4, 5, 2", b)
	}
	ok, bad := rep.Runs[0], rep.Runs[1]
	if first := rep.Runs[2]; first.OK() || first.Error != "round 1 of 3: bench: backend tcp: refused" || len(first.Rounds) != 1 {
		t.Errorf("isl 256: %+v", first)
	}
	if ok.GBps != 3 || len(ok.Rounds) != 3 || ok.Requests != 6 || ok.P50Ms != 20 || ok.P99Ms != 31 || !ok.OK() {
		t.Errorf("isl 64: %+v", ok)
	}
	// Best over best 3/5; by round 2/4, 3/5, 2.5/2: median 0.6.
	if !ratiosNear(ok.Ratios, []Ratio{{BaselineIperf3, 0.6}}) || !ratiosNear(ok.MedianRoundRatios, []Ratio{{BaselineIperf3, 0.6}}) {
		t.Errorf("isl 64 ratios %v, medians %v", ok.Ratios, ok.MedianRoundRatios)
	}
	if !ratiosNear(ok.Rounds[2].Ratios, []Ratio{{BaselineIperf3, 1.25}}) {
		t.Errorf("isl 64 round 3 ratios %v", ok.Rounds[2].Ratios)
	}
	if bad.OK() || bad.Error != "round 2 of 3: bench: context side: dead" || len(bad.Rounds) != 2 || !rep.Failed() {
		t.Errorf("isl 128: %+v", bad)
	}
	// Every run event names its round.
	for _, e := range events {
		if e.Phase != PhaseBaseline && (e.Rounds != 3 || e.Round < 1 || e.Round > 3) {
			t.Errorf("event %+v without its round", e)
		}
	}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"best of 3 rounds", "the baselines and the runs alternate round by round", "GB/s by round", "0.60× (0.60×)",
		"| 2.00 / 3.00 / 2.50 |", "| 1.00 / failed |"} {
		if !strings.Contains(md.String(), w) {
			t.Errorf("the Markdown lacks %q:\n%s", w, md.String())
		}
	}
	var tbl bytes.Buffer
	if err := rep.WriteTable(&tbl); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tbl.String(), "0.60x iperf3 (median of rounds 0.60x)") {
		t.Errorf("the table lacks the median:\n%s", tbl.String())
	}
}

// TestSweepOneRound: without Rounds a sweep measures the baselines and
// each run once, as before rounds existed, and rejects a negative count.
func TestSweepOneRound(t *testing.T) {
	var calls []string
	s := Sweep{
		Base: Config{Model: "tiny"}, ISLs: []int{64, 128}, Baseline: true,
		measureBaselines: func(_ context.Context, k int) []Baseline {
			calls = append(calls, fmt.Sprintf("baselines %d", k+1))
			return []Baseline{{Name: BaselineIperf3, GBps: 4}}
		},
		run: func(_ context.Context, c Config) (*Result, error) {
			calls = append(calls, fmt.Sprintf("run isl=%d", c.ISL))
			return round(2, 1, 2, 3), nil
		},
	}
	rep, err := RunSweep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"baselines 1", "run isl=64", "run isl=128"}; !slices.Equal(calls, want) {
		t.Errorf("calls %q, want %q", calls, want)
	}
	r := rep.Runs[0]
	if rep.Config.Rounds != 1 || r.GBps != 2 || r.P50Ms != 2 || len(r.Rounds) != 1 || !ratiosNear(r.Ratios, []Ratio{{BaselineIperf3, 0.5}}) ||
		!ratiosNear(r.MedianRoundRatios, r.Ratios) {
		t.Errorf("one round: %+v", r)
	}
	var md bytes.Buffer
	rep.WriteMarkdown(&md)
	if strings.Contains(md.String(), "round by round") || strings.Contains(md.String(), "GB/s by round") {
		t.Errorf("a report of one round talks of rounds:\n%s", md.String())
	}
	s.Rounds = -1
	if _, err := RunSweep(context.Background(), s); err == nil || !strings.Contains(err.Error(), "--rounds -1") {
		t.Errorf("rounds -1: %v", err)
	}
}

// TestBaselineRoundsSearchEvery: every round tries every setting (a
// setting that won the first round by chance does not stand for the tool
// after); a tool that is not installed is skipped once.
func TestBaselineRoundsSearchEvery(t *testing.T) {
	iperf3 := fakeIperf3(t)
	br := &baselineRunner{bytes: 4 << 20, timeout: time.Minute, report: func(Baseline, int) {},
		lookPath: func(name string) (string, error) {
			if name == "iperf3" {
				return iperf3, nil
			}
			return "", exec.ErrNotFound
		}}
	ms := []baselineMeasure{
		{BaselineCopy, func(context.Context) Baseline { return copyBaseline(br.bytes, 1) }},
		{BaselineIperf3, func(ctx context.Context) Baseline { return br.iperf3(ctx, 1) }},
		{BaselineUCXPerftest, br.ucxPerftest},
	}
	first := br.round(context.Background(), ms, 0)
	second := br.round(context.Background(), ms, 1)
	if len(first) != 3 || len(first[1].Variants) != 3 || first[1].Best != "-l 1M" || first[2].Skipped == "" {
		t.Fatalf("first round: %+v", first)
	}
	if len(second) != 2 {
		t.Fatalf("second round: %d baselines, want copy and iperf3 (ucx_perftest was skipped): %+v", len(second), second)
	}
	if v := second[1].Variants; len(v) != len(first[1].Variants) || second[1].Best != "-l 1M" || second[1].GBps <= 0 {
		t.Errorf("second round of iperf3: %+v, want every write length tried again", second[1])
	}
	if v := second[0].Variants; len(v) != len(first[0].Variants) {
		t.Errorf("second round of copy: %d settings, want the first round's %d", len(v), len(first[0].Variants))
	}
}

func TestProgressRounds(t *testing.T) {
	var plain, term bytes.Buffer
	lines, bar := NewProgress(&plain, false), NewProgress(&term, true)
	for _, e := range []Event{
		{Phase: PhaseBaseline, Baseline: &Baseline{Name: "copy", GBps: 9, Bytes: 1 << 20}, Round: 2, Rounds: 3},
		{Phase: PhaseMeasure, Run: 1, Runs: 2, Label: "tcp isl=64", Done: 1, Total: 2, Round: 2, Rounds: 3},
		{Phase: PhaseDone, Run: 2, Runs: 2, Label: "tcp isl=128", Result: &Result{GBps: 1.5, Backend: "tcp"}, Round: 2, Rounds: 3},
	} {
		lines(e)
		bar(e)
	}
	for _, want := range []string{"bench: round 2/3: baseline copy: 9.00 GB/s", "bench: round 2/3: run 2/2 tcp isl=128: 1.50 GB/s"} {
		if !strings.Contains(plain.String(), want) {
			t.Errorf("plain progress lacks %q:\n%s", want, plain.String())
		}
	}
	// Round 2 of 3, first run half done: (1 + 0.25) / 3.
	if !strings.Contains(term.String(), " 42%  round 2/3  run 1/2") || !strings.HasSuffix(term.String(), "\033[K") {
		t.Errorf("bar: %q", term.String())
	}
}
