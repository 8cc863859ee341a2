package engine

import "math"

// The kernels below are the only arithmetic of the model. Each one has a
// fixed order of operations that depends on the lengths of its operands
// only, never on which rank calls it: that, with the fixed reduction tree
// of the all-reduce, is what makes the numerics layout-invariant.

// dot returns Σ a[i]·b[i] in float64 with four interleaved partial sums,
// combined as (s0+s1)+(s2+s3). For float32 operands (all weights and all
// activations) each product is exact in float64, so a fused multiply-add
// gives the same result as a separate multiply and add.
//
// dot is exempt from the race detector: its operands are the model's
// immutable weights and the calling instance's own scratch, never pool
// memory (the cache is copied into scratch by decodeRow, which is
// instrumented), and instrumenting its loads makes -race runs of the
// model some twenty times slower.
//
//go:norace
func dot(a, b []float64) float64 {
	n := len(a)
	b = b[:n]
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= n; i += 4 {
		s0 += a[i] * b[i]
		s1 += a[i+1] * b[i+1]
		s2 += a[i+2] * b[i+2]
		s3 += a[i+3] * b[i+3]
	}
	for ; i < n; i++ {
		s0 += a[i] * b[i]
	}
	return (s0 + s1) + (s2 + s3)
}

// matVec sets out[r] = float32(dot(w[r×len(x):], x)) for r < len(out): w is
// a row-major [len(out)][len(x)] matrix.
func matVec(out, w, x []float64) {
	n := len(x)
	for r := range out {
		out[r] = r32(dot(w[r*n:(r+1)*n], x))
	}
}

// rmsNorm sets out = x / sqrt(mean(x²) + eps) × w, rounded to float32.
func rmsNorm(out, x, w []float64, eps float64) {
	var ss float64
	for _, v := range x {
		ss += v * v
	}
	inv := 1 / math.Sqrt(ss/float64(len(x))+eps)
	for i, v := range x {
		out[i] = r32(float64(v*inv) * w[i])
	}
}

// ropeTable holds cos and sin of position × invFreq for a run of positions.
type ropeTable struct {
	half     int
	cos, sin []float64 // [position - first][half]
}

func (rt *ropeTable) fill(invFreq []float64, first, n int) {
	rt.half = len(invFreq)
	rt.cos = grow(rt.cos, n*rt.half)
	rt.sin = grow(rt.sin, n*rt.half)
	for t := range n {
		p := float64(first + t)
		for i, f := range invFreq {
			s, c := math.Sincos(p * f)
			rt.cos[t*rt.half+i], rt.sin[t*rt.half+i] = c, s
		}
	}
}

// rotate applies rotate-half RoPE of the t-th position of the table to v
// (len 2×half) in place, rounding to float32. The explicit conversions
// keep the compiler from fusing the multiplies into the adds, which would
// change the rounding on some architectures.
func (rt *ropeTable) rotate(v []float64, t int) {
	h := rt.half
	cs, sn := rt.cos[t*h:(t+1)*h], rt.sin[t*h:(t+1)*h]
	for i := range h {
		x1, x2 := v[i], v[i+h]
		v[i] = r32(float64(x1*cs[i]) - float64(x2*sn[i]))
		v[i+h] = r32(float64(x1*sn[i]) + float64(x2*cs[i]))
	}
}

// softmaxInPlace turns scores into probabilities (float64, not rounded).
func softmaxInPlace(s []float64) {
	m := math.Inf(-1)
	for _, v := range s {
		m = max(m, v)
	}
	var sum float64
	for i, v := range s {
		e := math.Exp(v - m)
		s[i] = e
		sum += e
	}
	inv := 1 / sum
	for i := range s {
		s[i] *= inv
	}
}

// weightedSum sets out[d] = float32(Σ_j p[j]·rows[j×stride+off+d]).
func weightedSum(out, p, rows []float64, stride, off int) {
	for d := range out {
		out[d] = 0
	}
	acc := out // accumulate in place in float64, round at the end
	for j, pj := range p {
		row := rows[j*stride+off : j*stride+off+len(out)]
		for d, v := range row {
			acc[d] += float64(pj * v)
		}
	}
	for d := range out {
		out[d] = r32(acc[d])
	}
}

func silu(x float64) float64 { return x / (1 + math.Exp(-x)) }

// grow returns s resized to n, reusing its storage when it is large enough.
// The contents are not cleared.
func grow(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	return s[:n]
}
