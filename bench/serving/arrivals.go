package serving

import (
	"math"
	"math/rand/v2"
	"time"
)

// Arrivals returns the start offsets of n conversations at rate per
// second: the gaps between them are gamma-distributed with shape
// burstiness and mean 1/rate (burstiness 1 is a Poisson process; below 1
// the starts come in bursts, above 1 more evenly, as vllm's
// --burstiness). The first starts at 0. A rate of 0 or +Inf starts them
// all at 0. The same seed gives the same offsets.
func Arrivals(seed uint64, n int, rate, burstiness float64) []time.Duration {
	out := make([]time.Duration, n)
	if rate <= 0 || math.IsInf(rate, 1) || n == 0 {
		return out
	}
	r := rand.New(rand.NewPCG(seed, 0xa7))
	scale := 1 / (rate * burstiness) // mean = shape × scale = 1/rate
	t := 0.0
	for i := 1; i < n; i++ {
		t += gamma(r, burstiness) * scale
		out[i] = time.Duration(t * float64(time.Second))
	}
	return out
}

// gamma draws from the gamma distribution of the shape and scale 1
// (Marsaglia and Tsang's method; for a shape below 1, a draw of shape+1
// times U^(1/shape)).
func gamma(r *rand.Rand, shape float64) float64 {
	if shape < 1 {
		u := 1 - r.Float64() // (0, 1]
		return gamma(r, shape+1) * math.Pow(u, 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := r.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := 1 - r.Float64()
		if math.Log(u) < 0.5*x*x+d-d*v+d*math.Log(v) {
			return d * v
		}
	}
}
