//go:build !purego

package engine

// The AVX2/FMA kernels of kernels_amd64.s compute exactly what the
// portable kernels of kernels.go compute, in the same order (see dot32): the
// SIMD lanes are dot32's four partial sums. TestGemm, TestSoftmax and
// FuzzKernels check it bit for bit. They are used when the CPU has AVX2
// and FMA and the OS saves the YMM registers; build with -tags purego to
// use the portable kernels everywhere.

//go:noescape
func panel4(w *float32, k int, x *float64, xs int, t int, out *float64, os int, round int)

//go:noescape
func panel8(w *float32, k int, x *float64, out *float64, round int)

//go:noescape
func wsum32(acc *float64, p *float64, n int, v *float32, vs int)

//go:noescape
func wsum64(acc *float64, p *float64, n int, v *float64, vs int)

func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)

func xgetbv() (eax, edx uint32)

// haveSIMD reports whether the kernels of kernels_amd64.s may run here.
var haveSIMD = detectAVX2FMA()

func detectAVX2FMA() bool {
	maxID, _, _, _ := cpuid(0, 0)
	if maxID < 7 {
		return false
	}
	_, _, ecx1, _ := cpuid(1, 0)
	const fma, osxsave, avx = 1 << 12, 1 << 27, 1 << 28
	if ecx1&(fma|osxsave|avx) != fma|osxsave|avx {
		return false
	}
	if xcr0, _ := xgetbv(); xcr0&6 != 6 { // XMM and YMM state saved by the OS
		return false
	}
	_, ebx7, _, _ := cpuid(7, 0)
	const avx2 = 1 << 5
	return ebx7&avx2 != 0
}

//go:noescape
func scaleMax(s *float64, n int, f float64) (m float64)

//go:noescape
func mulScalar(s *float64, n int, f float64)

//go:noescape
func expSum(s *float64, n int, m, sum float64) (done int, total float64)

//go:noescape
func expVec(s *float64, n int) (done int)

//go:noescape
func bf16ToF32(dst *float32, src *byte, n int)
