package serving

import (
	"math"
	"slices"
	"testing"
	"time"
)

// TestArrivals: gaps of mean 1/rate whose coefficient of variation is
// 1/sqrt(burstiness) (the gamma's), starting at 0, non-decreasing, and
// the same for the same seed.
func TestArrivals(t *testing.T) {
	const n = 40000
	for _, tc := range []struct{ rate, burstiness float64 }{{1, 1}, {8, 1}, {4, 0.25}, {4, 0.5}, {2, 3}, {100, 10}} {
		a := Arrivals(7, n, tc.rate, tc.burstiness)
		if a[0] != 0 || !slices.IsSorted(a) {
			t.Fatalf("rate %v b %v: not starting at 0 and sorted", tc.rate, tc.burstiness)
		}
		var sum, sq float64
		for i := 1; i < n; i++ {
			g := (a[i] - a[i-1]).Seconds()
			sum += g
			sq += g * g
		}
		mean := sum / (n - 1)
		cv := math.Sqrt(sq/(n-1)-mean*mean) / mean
		if want := 1 / tc.rate; math.Abs(mean-want)/want > 0.03 {
			t.Errorf("rate %v b %v: mean gap %v, want %v ± 3%%", tc.rate, tc.burstiness, mean, want)
		}
		if want := 1 / math.Sqrt(tc.burstiness); math.Abs(cv-want)/want > 0.05 {
			t.Errorf("rate %v b %v: coefficient of variation %v, want %v ± 5%%", tc.rate, tc.burstiness, cv, want)
		}
		if b := Arrivals(7, n, tc.rate, tc.burstiness); !slices.Equal(a, b) {
			t.Errorf("rate %v b %v: not the same for the same seed", tc.rate, tc.burstiness)
		}
		if c := Arrivals(8, n, tc.rate, tc.burstiness); slices.Equal(a, c) {
			t.Errorf("rate %v b %v: seeds 7 and 8 give the same arrivals", tc.rate, tc.burstiness)
		}
	}
}

// TestArrivalsPoissonCounts: at burstiness 1 the number of starts in a
// second is Poisson: its variance equals its mean.
func TestArrivalsPoissonCounts(t *testing.T) {
	const rate, n = 5.0, 50000
	a := Arrivals(3, n, rate, 1)
	secs := int(a[n-1] / time.Second)
	counts := make([]float64, secs)
	for _, d := range a {
		if s := int(d / time.Second); s < secs {
			counts[s]++
		}
	}
	var sum, sq float64
	for _, c := range counts {
		sum += c
		sq += c * c
	}
	mean := sum / float64(secs)
	variance := sq/float64(secs) - mean*mean
	if math.Abs(mean-rate)/rate > 0.03 || math.Abs(variance-mean)/mean > 0.08 {
		t.Errorf("starts per second: mean %v variance %v, want both %v", mean, variance, rate)
	}
}

func TestArrivalsAllAtOnce(t *testing.T) {
	for _, rate := range []float64{0, math.Inf(1)} {
		for _, d := range Arrivals(1, 10, rate, 1) {
			if d != 0 {
				t.Fatalf("rate %v: an arrival at %v, want all at 0", rate, d)
			}
		}
	}
	if len(Arrivals(1, 0, 3, 1)) != 0 {
		t.Error("no arrivals asked, some given")
	}
}
