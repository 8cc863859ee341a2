package engine

import (
	"math"
	"runtime"
	"sync"
)

// The kernels below are the only arithmetic of the model. Each one has a
// fixed order of operations that depends on the lengths of its operands
// only, never on which rank calls it, how many rows are computed together,
// which kernel (SIMD or portable) or which core computes them: that, with
// the fixed reduction tree of the all-reduce, is what makes the numerics
// layout-invariant.

// dot32 returns Σ a[i]·b[i] of a float32 vector (weights, cached K) and
// a float64 one in float64, with four interleaved partial sums (s_k sums
// the products of the elements i ≡ k mod 4 in order of i, the n mod 4
// last ones going to s0), combined as (s0+s1)+(s2+s3). This is "dot's
// order", the one every kernel below keeps. For float32 operands (all
// weights and all activations) each product is exact in float64, so a
// fused multiply-add gives the same result as a separate multiply and
// add, and the four partial sums are the four lanes of an AVX2 register.
//
// dot32 and the other portable kernels are exempt from the race detector:
// their operands are the model's immutable weights and the calling
// instance's own scratch, never pool memory (the cache is copied into
// scratch by decodeRow32, which under the race detector is always
// instrumented Go), and instrumenting their
// loads makes -race runs of the model some twenty times slower.
//
//go:norace
func dot32(a []float32, b []float64) float64 {
	n := len(a)
	b = b[:n]
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= n; i += 4 {
		s0 += float64(a[i]) * b[i]
		s1 += float64(a[i+1]) * b[i+1]
		s2 += float64(a[i+2]) * b[i+2]
		s3 += float64(a[i+3]) * b[i+3]
	}
	for ; i < n; i++ {
		s0 += float64(a[i]) * b[i]
	}
	return (s0 + s1) + (s2 + s3)
}

// gemm sets out[t×os+j] = dot32(w[j×K:(j+1)×K], x[t×xs:t×xs+K]) for every
// row j < rows of w and token t < T of x, rounded to float32 when round.
// Each element is one dot32, whatever the blocking: the SIMD kernels
// compute four or eight rows and up to two tokens at a time (lanes in
// dot's order), the rest falls to dot32.
func gemm(out []float64, os int, w []float32, rows, K int, x []float64, xs, T int, round bool) {
	gemmWith(haveSIMD, out, os, w, rows, K, x, xs, T, round)
}

// gemmTokenBlock is the number of tokens whose activations stay in cache
// while the rows of w stream past them.
const gemmTokenBlock = 32

//go:norace
func gemmWith(simd bool, out []float64, os int, w []float32, rows, K int, x []float64, xs, T int, round bool) {
	if rows == 0 || T == 0 {
		return
	}
	// Bounds, checked once for the kernels that take pointers.
	_ = out[(T-1)*os+rows-1]
	if K > 0 {
		_ = w[rows*K-1]
		_ = x[(T-1)*xs+K-1]
	}
	j := 0
	if simd && K%4 == 0 && K > 0 {
		rnd := 0
		if round {
			rnd = 1
		}
		for t0 := 0; t0 < T; t0 += gemmTokenBlock {
			t1 := min(T, t0+gemmTokenBlock)
			j = 0
			if t1-t0 == 1 {
				for ; j+8 <= rows; j += 8 {
					panel8(&w[j*K], K, &x[t0*xs], &out[t0*os+j], rnd)
				}
			}
			for ; j+4 <= rows; j += 4 {
				panel4(&w[j*K], K, &x[t0*xs], xs, t1-t0, &out[t0*os+j], os, rnd)
			}
		}
	}
	for ; j < rows; j++ {
		wr := w[j*K : (j+1)*K]
		for t := range T {
			v := dot32(wr, x[t*xs:t*xs+K])
			if round {
				v = r32(v)
			}
			out[t*os+j] = v
		}
	}
}

// parallelMinWork is the number of multiply-adds below which an operation
// runs on the calling goroutine: waking another core costs some
// microseconds.
const parallelMinWork = 1 << 18

// workers is the number of goroutines an operation is split over.
func workers(work int) int {
	if work < parallelMinWork {
		return 1
	}
	return min(runtime.GOMAXPROCS(0), 8, max(1, work/parallelMinWork))
}

// parallel runs fn(i) for i < n on up to nw goroutines (the caller's
// included), each taking the next i; it returns when all are done. Which
// goroutine runs an fn(i) never changes what fn(i) computes.
func parallel(nw, n int, fn func(worker, i int)) {
	nw = min(nw, n)
	if nw <= 1 {
		for i := range n {
			fn(0, i)
		}
		return
	}
	var mu sync.Mutex
	next := 0
	take := func() int {
		mu.Lock()
		defer mu.Unlock()
		i := next
		next++
		return i
	}
	run := func(worker int) {
		for i := take(); i < n; i = take() {
			fn(worker, i)
		}
	}
	var wg sync.WaitGroup
	for wk := 1; wk < nw; wk++ {
		wg.Go(func() { run(wk) })
	}
	run(0)
	wg.Wait()
}

// gemmPar is gemm with the rows split over cores in blocks of 16 when the
// operation is large enough. Every element is still the same dot32.
func gemmPar(out []float64, os int, w []float32, rows, K int, x []float64, xs, T int, round bool) {
	nw := workers(rows * K * T)
	const blk = 16
	nb := (rows + blk - 1) / blk
	if nw <= 1 || nb < 2 {
		gemm(out, os, w, rows, K, x, xs, T, round)
		return
	}
	// Split into about four blocks per worker, whole blocks of rows.
	per := max(1, nb/(4*nw)) * blk
	parallel(nw, (rows+per-1)/per, func(_, i int) {
		lo, hi := i*per, min(rows, (i+1)*per)
		gemm(out[lo:], os, w[lo*K:], hi-lo, K, x, xs, T, round)
	})
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

// ropeTable holds cos and sin of position × invFreq for the rows of a
// batch.
type ropeTable struct {
	half     int
	cos, sin []float64 // [row][half]
}

// fill computes the table for rows at the given positions.
func (rt *ropeTable) fill(invFreq []float64, pos []int) {
	rt.half = len(invFreq)
	rt.cos = grow(rt.cos, len(pos)*rt.half)
	rt.sin = grow(rt.sin, len(pos)*rt.half)
	for t, p := range pos {
		for i, f := range invFreq {
			s, c := math.Sincos(float64(p) * f)
			rt.cos[t*rt.half+i], rt.sin[t*rt.half+i] = c, s
		}
	}
}

// rotate applies rotate-half RoPE of the t-th row of the table to v
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

// softmax scales the scores s by scale and turns them into probabilities
// (float64, not rounded): m = max(s×scale), e_j = expKernel(s_j×scale − m),
// summed in order of j, and p_j = e_j × (1/sum).
func softmax(s []float64, scale float64) { softmaxWith(haveSIMD, s, scale) }

//go:norace
func softmaxWith(simd bool, s []float64, scale float64) {
	n := len(s)
	if n == 0 {
		return
	}
	n4 := 0
	if simd {
		n4 = n &^ 3
	}
	m := math.Inf(-1)
	if n4 > 0 {
		m = scaleMax(&s[0], n4, scale)
	}
	for i := n4; i < n; i++ {
		s[i] *= scale
	}
	for _, v := range s[n4:] {
		m = max(m, v)
	}
	var sum float64
	i := 0
	for i < n {
		if i < n4 {
			var done int
			done, sum = expSum(&s[i], n4-i, m, sum)
			i += done
			if i >= n4 {
				continue
			}
			// A group of four with an argument the SIMD kernel leaves to
			// expKernel.
			for end := i + 4; i < end; i++ {
				e := expKernel(s[i] - m)
				s[i] = e
				sum += e
			}
			continue
		}
		e := expKernel(s[i] - m)
		s[i] = e
		sum += e
		i++
	}
	inv := 1 / sum
	if n4 > 0 {
		mulScalar(&s[0], n4, inv)
	}
	for i := n4; i < n; i++ {
		s[i] *= inv
	}
}

// expKernel is the engine's e^x, the same on every machine: the
// algorithm of the Go runtime's amd64 math.Exp on a CPU with FMA (Shibata's
// method: k = round(x·log2 e), x − k·ln2 in two fused steps, a Taylor
// polynomial of x/16 evaluated with fused multiply-adds, squared back four
// times, scaled by 2^k), written with math.FMA so that the same bits come
// out where math.Exp takes another path. Where the amd64 math.Exp uses
// FMA, expKernel(x) == math.Exp(x) for every x (TestExpKernel); the SIMD
// softmax computes four of them at a time with the same operations.
func expKernel(x float64) float64 {
	const (
		log2e    = 1.4426950408889634073599246810018920
		ln2U     = 0.69314718055966295651160180568695068359375
		ln2L     = 0.28235290563031577122588448175013436025525412068e-12
		overflow = 7.09782712893384e+02
	)
	switch {
	case math.IsNaN(x) || math.IsInf(x, 1):
		return x
	case math.IsInf(x, -1):
		return 0
	case x > overflow:
		return math.Inf(1)
	}
	t := log2e * x
	// CVTSD2SL: round to nearest even; out of the int32 range it gives
	// the "integer indefinite" 0x80000000.
	k := int64(math.MinInt32)
	if r := math.RoundToEven(t); r >= math.MinInt32 && r <= math.MaxInt32 {
		k = int64(r)
	}
	kf := float64(k)
	x = math.FMA(-kf, ln2U, x)
	x = math.FMA(-kf, ln2L, x)
	x *= 0.0625
	p := 2.4801587301587301587e-5
	p = math.FMA(x, p, 1.9841269841269841270e-4)
	p = math.FMA(x, p, 1.3888888888888888889e-3)
	p = math.FMA(x, p, 8.3333333333333333333e-3)
	p = math.FMA(x, p, 4.1666666666666666667e-2)
	p = math.FMA(x, p, 1.6666666666666666667e-1)
	p = math.FMA(x, p, 0.5)
	p = math.FMA(x, p, 1.0)
	x = float64(x * p)
	x = float64(x * float64(x+2))
	x = float64(x * float64(x+2))
	x = float64(x * float64(x+2))
	x = math.FMA(x+2, x, 1.0)
	// Times 2^k, through the subnormal range as the runtime's code goes.
	b := k + 0x3ff
	switch {
	case b >= 0x7ff:
		return math.Inf(1)
	case b > 0:
		return x * math.Float64frombits(uint64(b)<<52)
	case b < -52:
		return 0
	}
	x *= math.Float64frombits(uint64(b+0x3fe) << 52)
	return x * math.Float64frombits(1<<52)
}

// weightedSum sets out[d] = float32(Σ_j float64(p[j]·rows[j×stride+off+d]))
// for d < len(out): the products rounded to float64 and added in order of
// j, starting from zero.
func weightedSum(out, p []float64, rows []float32, stride, off int) {
	weightedSumWith(haveSIMD, out, p, rows, stride, off)
}

//go:norace
func weightedSumWith(simd bool, out, p []float64, rows []float32, stride, off int) {
	clear(out)
	n := len(p)
	if n == 0 || len(out) == 0 {
		return
	}
	_ = rows[(n-1)*stride+off+len(out)-1]
	d := 0
	if simd {
		for ; d+32 <= len(out); d += 32 {
			wsum32(&out[d], &p[0], n, &rows[off+d], stride)
		}
	}
	if d < len(out) {
		acc := out[d:] // accumulate in place in float64, round at the end
		for j, pj := range p {
			row := rows[j*stride+off+d : j*stride+off+len(out)]
			for i, v := range row {
				acc[i] += float64(pj * float64(v))
			}
		}
	}
	for i := range out {
		out[i] = r32(out[i])
	}
}

func silu(x float64) float64 { return x / (1 + expKernel(-x)) }

// siluMul sets gate[i] = float32(silu(gate[i]) × up[i]), using e as
// scratch (len(gate)).
func siluMul(gate, up, e []float64) { siluMulWith(haveSIMD, gate, up, e) }

//go:norace
func siluMulWith(simd bool, gate, up, e []float64) {
	n := len(gate)
	up, e = up[:n], e[:n]
	for i, g := range gate {
		e[i] = -g
	}
	i := 0
	if simd {
		n4 := n &^ 3
		for i < n4 {
			i += expVec(&e[i], n4-i)
			if i < n4 {
				// A group of four the SIMD kernel leaves to expKernel.
				for end := i + 4; i < end; i++ {
					e[i] = expKernel(e[i])
				}
			}
		}
	}
	for ; i < n; i++ {
		e[i] = expKernel(e[i])
	}
	for i, g := range gate {
		gate[i] = r32(g / (1 + e[i]) * up[i])
	}
}

// grow returns s resized to n, reusing its storage when it is large enough.
// The contents are not cleared.
func grow[E any](s []E, n int) []E {
	if cap(s) < n {
		return make([]E, n)
	}
	return s[:n]
}
