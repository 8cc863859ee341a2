//go:build !amd64 || purego

package engine

// Without the amd64 kernels, the portable ones of kernels.go run
// everywhere; they compute the same results.

const haveSIMD = false

func panel4(w *float32, k int, x *float64, xs int, t int, out *float64, os int, round int) {
	panic("engine: panel4 without SIMD")
}

func panel8(w *float32, k int, x *float64, out *float64, round int) {
	panic("engine: panel8 without SIMD")
}

func wsum32(acc *float64, p *float64, n int, v *float32, vs int) {
	panic("engine: wsum32 without SIMD")
}

func wsum64(acc *float64, p *float64, n int, v *float64, vs int) {
	panic("engine: wsum64 without SIMD")
}

func scaleMax(s *float64, n int, f float64) float64 { panic("engine: scaleMax without SIMD") }

func mulScalar(s *float64, n int, f float64) { panic("engine: mulScalar without SIMD") }

func expSum(s *float64, n int, m, sum float64) (int, float64) { panic("engine: expSum without SIMD") }

func expVec(s *float64, n int) int { panic("engine: expVec without SIMD") }

func bf16ToF32(dst *float32, src *byte, n int) { panic("engine: bf16ToF32 without SIMD") }
