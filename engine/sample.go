package engine

import (
	"math"
	"math/rand/v2"
)

// Sampling is how the next token is chosen.
type Sampling struct {
	// Temperature 0 is greedy (argmax, lowest id on ties); above 0 the
	// token is drawn from softmax(logits / Temperature).
	Temperature float64
	// Seed makes sampling deterministic: the draw for the k-th generated
	// token uses PCG(Seed, k), so a context instance sampling the first
	// token and a generation instance sampling the rest draw exactly what
	// one instance would. Without a seed the engine picks one at random.
	Seed *uint64
}

// sampleToken chooses a token from logits. BOS is never chosen. index is
// the position of the token among the generated ones (0 for the first).
func sampleToken(logits []float32, temp float64, seed uint64, index int) int32 {
	if temp <= 0 {
		best := int32(-1)
		for i, l := range logits {
			if int32(i) == BOS {
				continue
			}
			if best < 0 || l > logits[best] {
				best = int32(i)
			}
		}
		return best
	}
	m := math.Inf(-1)
	for i, l := range logits {
		if int32(i) != BOS {
			m = max(m, float64(l))
		}
	}
	p := make([]float64, len(logits))
	var sum float64
	for i, l := range logits {
		if int32(i) == BOS {
			continue
		}
		p[i] = math.Exp((float64(l) - m) / temp)
		sum += p[i]
	}
	src := rand.NewPCG(seed, uint64(index))
	u := float64(src.Uint64()>>11) * 0x1p-53 * sum
	last := int32(-1)
	for i, pi := range p {
		if pi == 0 {
			continue
		}
		last = int32(i)
		if u < pi {
			return int32(i)
		}
		u -= pi
	}
	return last // rounding left u just above the total
}
