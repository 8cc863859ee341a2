package serving

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// naivePercentile is the reference: the k-th smallest sample found by
// counting, for the two ranks around h = (n-1)·p/100, linearly
// interpolated. It never sorts.
func naivePercentile(samples []float64, p float64) float64 {
	kth := func(k int) float64 {
		for _, x := range samples {
			less, leq := 0, 0
			for _, y := range samples {
				if y < x {
					less++
				}
				if y <= x {
					leq++
				}
			}
			if less <= k && k < leq {
				return x
			}
		}
		panic("no k-th")
	}
	h := float64(len(samples)-1) * p / 100
	lo := int(math.Floor(h))
	hi := min(lo+1, len(samples)-1)
	return kth(lo) + (h-float64(lo))*(kth(hi)-kth(lo))
}

// TestPercentileAgainstNaive: Percentile over sorted samples equals the
// counting reference, for random sets with ties, and lies between the
// minimum and maximum.
func TestPercentileAgainstNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for trial := range 300 {
		n := 1 + r.IntN(60)
		s := make([]float64, n)
		for i := range s {
			s[i] = float64(r.IntN(20)) + r.Float64()*float64(trial%2) // ties when trial is even
		}
		sorted := slices.Sorted(slices.Values(s))
		for _, p := range []float64{0, 1, 10, 25, 50, 90, 99, 99.9, 100, r.Float64() * 100} {
			got, want := Percentile(sorted, p), naivePercentile(s, p)
			if math.Abs(got-want) > 1e-9 {
				t.Fatalf("trial %d: p%v of %v = %v, want %v", trial, p, s, got, want)
			}
			if got < sorted[0] || got > sorted[n-1] {
				t.Fatalf("p%v = %v outside [%v, %v]", p, got, sorted[0], sorted[n-1])
			}
		}
	}
}

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		name    string
		samples []float64
		want    Dist
	}{
		{"none", nil, Dist{}},
		{"one", []float64{7}, Dist{Mean: 7, P50: 7, P90: 7, P99: 7, Max: 7, N: 1}},
		{"1..5", []float64{5, 1, 4, 2, 3}, Dist{Mean: 3, P50: 3, P90: 4.6, P99: 4.96, Max: 5, N: 5}},
		{"two", []float64{10, 0}, Dist{Mean: 5, P50: 5, P90: 9, P99: 9.9, Max: 10, N: 2}},
	} {
		got := Summarize(tc.samples)
		if math.Abs(got.Mean-tc.want.Mean)+math.Abs(got.P50-tc.want.P50)+math.Abs(got.P90-tc.want.P90)+
			math.Abs(got.P99-tc.want.P99)+math.Abs(got.Max-tc.want.Max) > 1e-9 || got.N != tc.want.N {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func msd(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// TestTPOT: (E2EL − TTFT) / (tokens − 1), none below two tokens.
func TestTPOT(t *testing.T) {
	for _, tc := range []struct {
		ttft, e2el float64
		tokens     int
		want       float64
		ok         bool
	}{
		{100, 190, 10, 10, true},
		{100, 105, 2, 5, true},
		{100, 100, 1, 0, false},
		{100, 100, 0, 0, false},
	} {
		got, ok := TPOT(&Record{TTFT: msd(tc.ttft), E2EL: msd(tc.e2el), OutputTokens: tc.tokens})
		if ok != tc.ok || math.Abs(ms(got)-tc.want) > 1e-6 {
			t.Errorf("TPOT(ttft %v, e2el %v, %d tokens) = %v %v, want %v %v", tc.ttft, tc.e2el, tc.tokens, ms(got), ok, tc.want, tc.ok)
		}
	}
}

func TestParseSLO(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want SLO
		bad  bool
	}{
		{nil, SLO{}, false},
		{[]string{"ttft:200 tpot:20"}, SLO{TTFTMs: 200, TPOTMs: 20}, false},
		{[]string{"ttft:200", "tpot:20", "e2el:5000"}, SLO{TTFTMs: 200, TPOTMs: 20, E2ELMs: 5000}, false},
		{[]string{"ttft:1.5,e2el:9"}, SLO{TTFTMs: 1.5, E2ELMs: 9}, false},
		{[]string{"ttft"}, SLO{}, true},
		{[]string{"ttft:-1"}, SLO{}, true},
		{[]string{"ttft:0"}, SLO{}, true},
		{[]string{"itl:5"}, SLO{}, true},
		{[]string{"ttft:abc"}, SLO{}, true},
	} {
		got, err := ParseSLO(tc.args)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("ParseSLO(%q) = %+v, %v; want %+v, error %v", tc.args, got, err, tc.want, tc.bad)
		}
	}
}

// TestGoodput: a request is good when it completed and meets every set
// objective; goodput is good requests per second of the run.
func TestGoodput(t *testing.T) {
	recs := []Record{
		{TTFT: msd(100), E2EL: msd(290), OutputTokens: 20},                       // tpot 10: good
		{TTFT: msd(250), E2EL: msd(440), OutputTokens: 20},                       // ttft too long
		{TTFT: msd(100), E2EL: msd(670), OutputTokens: 20},                       // tpot 30: too long
		{TTFT: msd(150), E2EL: msd(150), OutputTokens: 1},                        // one token: no tpot, good
		{TTFT: msd(10), E2EL: msd(20), OutputTokens: 2, ErrorKind: ErrorHTTP5xx}, // failed
	}
	for _, tc := range []struct {
		slo  SLO
		good int
	}{
		{SLO{TTFTMs: 200, TPOTMs: 20}, 2},
		{SLO{TTFTMs: 200}, 3},
		{SLO{TPOTMs: 20}, 3},
		{SLO{E2ELMs: 300}, 2},
		{SLO{TTFTMs: 1000, TPOTMs: 1000, E2ELMs: 10000}, 4},
	} {
		m := Compute(recs, 2*time.Second, tc.slo)
		if m.GoodRequests != tc.good || m.Goodput == nil || math.Abs(*m.Goodput-float64(tc.good)/2) > 1e-12 {
			t.Errorf("SLO %+v: %d good, goodput %v; want %d, %v", tc.slo, m.GoodRequests, m.Goodput, tc.good, float64(tc.good)/2)
		}
	}
	if m := Compute(recs, time.Second, SLO{}); m.Goodput != nil || m.GoodRequests != 0 {
		t.Errorf("without an SLO: goodput %v, %d good; want none", m.Goodput, m.GoodRequests)
	}
}

// TestCompute: counts, throughputs, ITL pooled over requests, errors by
// kind, KV bytes and share of TTFT from the requests that moved KV.
func TestCompute(t *testing.T) {
	recs := []Record{
		{PromptTokens: 100, MaxTokens: 4, OutputTokens: 4, TTFT: msd(40), E2EL: msd(70), ITL: []time.Duration{msd(10), msd(10), msd(10)},
			Timing: &Timing{KVTransferMs: 4, KVTransferBytes: 1000}},
		{PromptTokens: 50, MaxTokens: 4, OutputTokens: 3, TTFT: msd(20), E2EL: msd(60), ITL: []time.Duration{msd(20), msd(20)},
			Timing: &Timing{KVTransferMs: 10, KVTransferBytes: 3000}},
		{PromptTokens: 50, MaxTokens: 4, OutputTokens: 4, TTFT: msd(30), E2EL: msd(30), Timing: &Timing{}}, // aggregated: no KV moved
		{PromptTokens: 10, MaxTokens: 4, ErrorKind: ErrorEvent},
		{PromptTokens: 10, MaxTokens: 4, ErrorKind: ErrorEvent},
		{PromptTokens: 10, MaxTokens: 4, ErrorKind: ErrorConnect},
	}
	m := Compute(recs, 2*time.Second, SLO{})
	if m.Completed != 3 || m.Failed != 3 || m.ErrorsByKind[ErrorEvent] != 2 || m.ErrorsByKind[ErrorConnect] != 1 || len(m.ErrorsByKind) != 2 {
		t.Errorf("completed %d failed %d by kind %v", m.Completed, m.Failed, m.ErrorsByKind)
	}
	if m.TotalInput != 200 || m.TotalOutput != 11 || m.RequestedOutput != 12 {
		t.Errorf("tokens: input %d output %d requested %d", m.TotalInput, m.TotalOutput, m.RequestedOutput)
	}
	if m.RequestThroughput != 1.5 || m.OutputThroughput != 5.5 || m.TotalTokenThroughput != 105.5 {
		t.Errorf("throughput: %v req/s, %v out tok/s, %v tok/s", m.RequestThroughput, m.OutputThroughput, m.TotalTokenThroughput)
	}
	if m.ITL.N != 5 || math.Abs(m.ITL.Mean-14) > 1e-9 || m.ITL.Max != 20 {
		t.Errorf("ITL %+v, want 5 samples, mean 14, max 20", m.ITL)
	}
	// TPOT: (70-40)/3 = 10, (60-20)/2 = 20, none for the third (its E2EL
	// equals its TTFT over 4 tokens: 0).
	if m.TPOT.N != 3 || math.Abs(m.TPOT.Mean-10) > 1e-9 {
		t.Errorf("TPOT %+v, want 3 samples, mean 10", m.TPOT)
	}
	if m.KVBytes.N != 2 || m.KVBytes.Mean != 2000 || math.Abs(m.KVShareTTFT.Mean-0.3) > 1e-9 || m.KVTransferMs.Max != 10 {
		t.Errorf("KV: bytes %+v share %+v ms %+v", m.KVBytes, m.KVShareTTFT, m.KVTransferMs)
	}
}
