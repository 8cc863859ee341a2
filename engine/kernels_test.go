package engine

import (
	"context"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
)

// naiveDot is the reference of dot's order: four partial sums by index
// mod 4, the n mod 4 last products into the first, added as
// (s0+s1)+(s2+s3).
func naiveDot(a []float32, b []float64) float64 {
	var s [4]float64
	n := len(a)
	for i := range n - n%4 {
		s[i%4] += float64(a[i]) * b[i]
	}
	for i := n - n%4; i < n; i++ {
		s[0] += float64(a[i]) * b[i]
	}
	return (s[0] + s[1]) + (s[2] + s[3])
}

// randF32 returns a float32 value spread over many binades, as weights
// and activations are.
func randF32(r *rand.Rand) float32 {
	return float32(r.NormFloat64() * math.Exp2(float64(r.IntN(9)-4)))
}

func sameBits(a, b float64) bool { return math.Float64bits(a) == math.Float64bits(b) }

// gemmCase fills a random gemm problem; the output is pre-filled with a
// marker that must stay where gemm writes nothing.
type gemmCase struct {
	rows, K, T, xs, os int
	round              bool
	w                  []float32
	x                  []float64
}

func newGemmCase(r *rand.Rand, rows, K, T int, round bool) gemmCase {
	c := gemmCase{rows: rows, K: K, T: T, xs: K + r.IntN(3), os: rows + r.IntN(3), round: round}
	c.w = make([]float32, rows*K)
	for i := range c.w {
		c.w[i] = randF32(r)
	}
	c.x = make([]float64, (T-1)*c.xs+K)
	for i := range c.x {
		c.x[i] = float64(randF32(r))
	}
	return c
}

func (c gemmCase) run(simd bool) []float64 {
	out := make([]float64, (c.T-1)*c.os+c.rows+1)
	for i := range out {
		out[i] = -7
	}
	gemmWith(simd, out, c.os, c.w, c.rows, c.K, c.x, c.xs, c.T, c.round)
	return out
}

func (c gemmCase) check(t *testing.T, got []float64, what string) {
	t.Helper()
	for tok := range c.T {
		for j := range c.rows {
			want := naiveDot(c.w[j*c.K:(j+1)*c.K], c.x[tok*c.xs:tok*c.xs+c.K])
			if c.round {
				want = r32(want)
			}
			if g := got[tok*c.os+j]; !sameBits(g, want) {
				t.Fatalf("%s rows=%d K=%d T=%d round=%v: out[%d][%d] = %v, want %v", what, c.rows, c.K, c.T, c.round, tok, j, g, want)
			}
		}
		for j := c.rows; j < c.os && tok*c.os+j < len(got); j++ {
			if got[tok*c.os+j] != -7 {
				t.Fatalf("%s rows=%d K=%d T=%d: wrote out[%d][%d] past the rows", what, c.rows, c.K, c.T, tok, j)
			}
		}
	}
}

// TestGemm: the portable and (where the CPU has them) the SIMD kernels
// give every element of a matrix product bit for bit as the naive
// reference of dot's order, whatever the shape, strides and blocking.
func TestGemm(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	shapes := [][3]int{{3, 0, 2}, {1, 1, 1}, {4, 4, 1}, {8, 4, 1}, {8, 32, 1}, {16, 256, 1}, {4, 32, 2}, {4, 32, 3},
		{13, 36, 5}, {258, 256, 1}, {258, 256, 3}, {64, 64, 33}, {9, 7, 4}, {12, 40, 70}}
	for range 40 {
		shapes = append(shapes, [3]int{1 + r.IntN(24), 1 + r.IntN(80), 1 + r.IntN(40)})
	}
	for _, sh := range shapes {
		for _, round := range []bool{false, true} {
			c := newGemmCase(r, sh[0], sh[1], sh[2], round)
			c.check(t, c.run(false), "portable")
			if haveSIMD {
				c.check(t, c.run(true), "simd")
			}
		}
	}
}

// TestGemmParallel: splitting the rows over cores changes nothing.
func TestGemmParallel(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	c := newGemmCase(r, 514, 256, 9, true)
	want := c.run(haveSIMD)
	got := make([]float64, len(want))
	for i := range got {
		got[i] = -7
	}
	gemmPar(got, c.os, c.w, c.rows, c.K, c.x, c.xs, c.T, c.round)
	for i := range got {
		if !sameBits(got[i], want[i]) {
			t.Fatalf("element %d: parallel %v, serial %v", i, got[i], want[i])
		}
	}
}

func naiveWeightedSum(n int, p []float64, rows []float32, stride, off int) []float64 {
	out := make([]float64, n)
	for d := range out {
		var acc float64
		for j, pj := range p {
			acc += pj * float64(rows[j*stride+off+d])
		}
		out[d] = r32(acc)
	}
	return out
}

// TestWeightedSum: both kernels against the naive sum in order of j.
func TestWeightedSum(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, sh := range [][3]int{{32, 1, 0}, {32, 100, 0}, {64, 17, 32}, {33, 5, 1}, {7, 3, 2}, {96, 40, 0}} {
		d, n, off := sh[0], sh[1], sh[2]
		stride := d + off + r.IntN(4)
		p := make([]float64, n)
		for i := range p {
			p[i] = r.Float64()
		}
		rows := make([]float32, n*stride)
		for i := range rows {
			rows[i] = randF32(r)
		}
		want := naiveWeightedSum(d, p, rows, stride, off)
		for _, simd := range []bool{false, haveSIMD} {
			got := make([]float64, d)
			weightedSumWith(simd, got, p, rows, stride, off)
			for i := range got {
				if !sameBits(got[i], want[i]) {
					t.Fatalf("simd=%v d=%d n=%d: out[%d] = %v, want %v", simd, d, n, i, got[i], want[i])
				}
			}
		}
	}
}

// TestAttendTiled: a head's attention with the SIMD kernels (the weighted
// sums tiled over positions) equals the portable one bit for bit, for
// blocks cut anywhere and contexts over several tiles.
func TestAttendTiled(t *testing.T) {
	if !haveSIMD {
		t.Skip("no SIMD kernels on this machine")
	}
	r := rand.New(rand.NewPCG(15, 16))
	const D = 32
	for _, sh := range [][2]int{{0, 1}, {0, 13}, {5, 1}, {100, 9}, {0, 300}, {250, 17}, {127, 2}} {
		n0, T := sh[0], sh[1]
		N := n0 + T
		var sc attnScratch
		sc.k, sc.v, sc.v64 = make([]float32, (N+4)*D), make([]float32, N*D), make([]float64, N*D)
		for i := range N * D {
			sc.k[i], sc.v[i] = randF32(r)/4, randF32(r)
			sc.v64[i] = float64(sc.v[i])
		}
		qs := 3 * D
		q := make([]float64, T*qs)
		for i := range q {
			q[i] = float64(randF32(r))
		}
		want, got := make([]float64, T*qs), make([]float64, T*qs)
		sc.attendWith(false, context.Background(), want, q, qs, n0, T, D, 0.17677669529663687)
		sc.attendWith(true, context.Background(), got, q, qs, n0, T, D, 0.17677669529663687)
		for i := range want {
			if !sameBits(got[i], want[i]) {
				t.Fatalf("n0=%d T=%d: o[%d] = %v tiled, %v portable", n0, T, i, got[i], want[i])
			}
		}
	}
}

func naiveSoftmax(s []float64, scale float64) []float64 {
	out := make([]float64, len(s))
	m := math.Inf(-1)
	for i, v := range s {
		out[i] = v * scale
		m = max(m, out[i])
	}
	var sum float64
	for i, v := range out {
		out[i] = expKernel(v - m)
		sum += out[i]
	}
	inv := 1 / sum
	for i := range out {
		out[i] *= inv
	}
	return out
}

// TestSoftmax: both kernels against the naive softmax, with scores spread
// far enough that some exponents underflow into the subnormals and to zero
// (the groups the SIMD kernel hands to expKernel).
func TestSoftmax(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{1, 3, 4, 5, 8, 31, 64, 257, 1000} {
		for _, spread := range []float64{1, 30, 800} {
			s := make([]float64, n)
			for i := range s {
				s[i] = r.NormFloat64() * spread
			}
			want := naiveSoftmax(s, 0.17677669529663687)
			for _, simd := range []bool{false, haveSIMD} {
				got := append([]float64(nil), s...)
				softmaxWith(simd, got, 0.17677669529663687)
				for i := range got {
					if !sameBits(got[i], want[i]) {
						t.Fatalf("simd=%v n=%d spread=%v: p[%d] = %v, want %v", simd, n, spread, i, got[i], want[i])
					}
				}
			}
		}
	}
}

// TestSiluMul: both kernels against silu, with arguments beyond the SIMD
// kernel's range.
func TestSiluMul(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, n := range []int{1, 4, 7, 64, 513} {
		for _, spread := range []float64{1, 10, 1000} {
			gate, up := make([]float64, n), make([]float64, n)
			for i := range gate {
				gate[i], up[i] = float64(float32(r.NormFloat64()*spread)), float64(randF32(r))
			}
			for _, simd := range []bool{false, haveSIMD} {
				got := append([]float64(nil), gate...)
				siluMulWith(simd, got, up, make([]float64, n))
				for i, g := range gate {
					if want := r32(silu(g) * up[i]); !sameBits(got[i], want) {
						t.Fatalf("simd=%v n=%d: silu(%v)·%v = %v, want %v", simd, n, g, up[i], got[i], want)
					}
				}
			}
		}
	}
}

// TestExpKernel: expKernel is the runtime's math.Exp where that one runs
// its FMA path (amd64 with AVX and FMA, which haveSIMD implies), over the
// whole range, the subnormal results and the special values; elsewhere it
// stays within an ulp or so of it.
func TestExpKernel(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	xs := []float64{0, math.Copysign(0, -1), 1, -1, 0.5, 709.78, 709.79, -708.4, -708.39, -744.4, -745.2, -746,
		-1e300, 1e300, math.Inf(1), math.Inf(-1), math.NaN(), 5e-324, -5e-324, math.SmallestNonzeroFloat64}
	for range 200000 {
		xs = append(xs, (r.Float64()*2-1)*750, r.NormFloat64()*4, -r.ExpFloat64()*30)
	}
	exact := runtime.GOARCH == "amd64" && haveSIMD
	for _, x := range xs {
		got, want := expKernel(x), math.Exp(x)
		switch {
		case math.IsNaN(want):
			if !math.IsNaN(got) {
				t.Fatalf("expKernel(%v) = %v, want NaN", x, got)
			}
		case exact && !sameBits(got, want):
			t.Fatalf("expKernel(%v) = %v (%#x), math.Exp %v (%#x)", x, got, math.Float64bits(got), want, math.Float64bits(want))
		case !exact && math.Abs(got-want) > 4e-16*want:
			t.Fatalf("expKernel(%v) = %v, math.Exp %v", x, got, want)
		}
	}
}

// FuzzKernels: on any operands, the SIMD kernels compute what the
// portable ones do, bit for bit (NaNs compared as NaNs).
func FuzzKernels(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef"), uint8(3), uint8(2))
	f.Add(make([]byte, 300), uint8(8), uint8(1))
	f.Fuzz(func(t *testing.T, data []byte, rowsB, tB uint8) {
		if !haveSIMD {
			t.Skip("no SIMD kernels on this machine")
		}
		rows, T := 1+int(rowsB%16), 1+int(tB%5)
		K := 4 * (1 + len(data)/64%16)
		val := func(i int) uint32 {
			if len(data) < 4 {
				return uint32(i * 2654435761)
			}
			j := (4 * i) % (len(data) - 3)
			return binary.LittleEndian.Uint32(data[j:]) ^ uint32(i*2654435761)
		}
		w := make([]float32, rows*K)
		for i := range w {
			w[i] = math.Float32frombits(val(i))
		}
		x := make([]float64, T*K)
		for i := range x {
			x[i] = float64(math.Float32frombits(val(i + len(w))))
		}
		for _, round := range []bool{false, true} {
			a := make([]float64, T*rows)
			b := make([]float64, T*rows)
			gemmWith(false, a, rows, w, rows, K, x, K, T, round)
			gemmWith(true, b, rows, w, rows, K, x, K, T, round)
			for i := range a {
				if !sameBits(a[i], b[i]) && !(math.IsNaN(a[i]) && math.IsNaN(b[i])) {
					t.Fatalf("gemm rows=%d K=%d T=%d round=%v: element %d portable %v, simd %v", rows, K, T, round, i, a[i], b[i])
				}
			}
		}
		g1, g2, up := append([]float64(nil), x...), append([]float64(nil), x...), make([]float64, len(x))
		for i := range up {
			up[i] = float64(w[i%len(w)])
		}
		siluMulWith(false, g1, up, make([]float64, len(x)))
		siluMulWith(true, g2, up, make([]float64, len(x)))
		for i := range g1 {
			if !sameBits(g1[i], g2[i]) && !(math.IsNaN(g1[i]) && math.IsNaN(g2[i])) {
				t.Fatalf("silu of %v: portable %v, simd %v", x[i], g1[i], g2[i])
			}
		}
		s := make([]float64, len(x))
		for i, v := range x {
			s[i] = math.Mod(v, 1e4)
		}
		a, b := append([]float64(nil), s...), append([]float64(nil), s...)
		softmaxWith(false, a, 0.125)
		softmaxWith(true, b, 0.125)
		for i := range a {
			if !sameBits(a[i], b[i]) && !(math.IsNaN(a[i]) && math.IsNaN(b[i])) {
				t.Fatalf("softmax n=%d: p[%d] portable %v, simd %v", len(s), i, a[i], b[i])
			}
		}
	})
}
