//go:build !purego

#include "textflag.h"

// The AVX2 kernels of kernels_amd64.go. Each float64 lane k of a dot
// product's accumulator sums the products of the elements i ≡ k (mod 4) in
// order of i: the four partial sums s0..s3 of dot32, computed side by
// side. The products of float32 values are exact in float64, so the fused
// multiply-add rounds exactly as the separate multiply and add of the Go
// code. RED4 combines the lanes as (s0+s1)+(s2+s3).

// RED4 reduces the lane vectors a, b, c, d of four dot products to one
// vector [a, b, c, d] in a, each as (s0+s1)+(s2+s3); t is a temporary.
#define RED4(a, b, c, d, t) \
	VHADDPD b, a, a \
	VHADDPD d, c, c \
	VPERM2F128 $0x20, c, a, t \
	VPERM2F128 $0x31, c, a, a \
	VADDPD a, t, a

// ROUND32 rounds the four float64 of y to float32 precision (as
// float64(float32(v))) when R15 is not zero; xt is a temporary.
#define ROUND32(y, xt, skip) \
	TESTQ R15, R15 \
	JZ skip \
	VCVTPD2PSY y, xt \
	VCVTPS2PD xt, y \
skip:

// func panel4(w *float32, k int, x *float64, xs int, t int, out *float64, os int, round int)
// For the four rows w[r*k:][:k] (r < 4) and the t tokens x[i*xs:][:k]:
// out[i*os+r] = dot, rounded to float32 if round != 0. k%4 == 0, k > 0.
// Tokens go two at a time (eight accumulators), the last odd one alone.
TEXT ·panel4(SB), NOSPLIT, $0-64
	MOVQ w+0(FP), SI
	MOVQ k+8(FP), CX
	MOVQ x+16(FP), DI
	MOVQ xs+24(FP), DX
	MOVQ t+32(FP), R13
	MOVQ out+40(FP), R8
	MOVQ os+48(FP), R14
	MOVQ round+56(FP), R15
	MOVQ CX, BX
	SHLQ $2, BX
	SHLQ $3, DX
	SHLQ $3, R14
	LEAQ (SI)(BX*1), R9
	LEAQ (R9)(BX*1), R10
	LEAQ (R10)(BX*1), R11
panel4pair:
	CMPQ R13, $2
	JLT  panel4single
	LEAQ (DI)(DX*1), R12
	VXORPD Y0, Y0, Y0
	VXORPD Y1, Y1, Y1
	VXORPD Y2, Y2, Y2
	VXORPD Y3, Y3, Y3
	VXORPD Y4, Y4, Y4
	VXORPD Y5, Y5, Y5
	VXORPD Y6, Y6, Y6
	VXORPD Y7, Y7, Y7
	XORQ AX, AX
panel4loop2:
	VMOVUPD   (DI)(AX*8), Y8
	VMOVUPD   (R12)(AX*8), Y9
	VCVTPS2PD (SI)(AX*4), Y10
	VCVTPS2PD (R9)(AX*4), Y11
	VFMADD231PD Y8, Y10, Y0
	VFMADD231PD Y9, Y10, Y1
	VFMADD231PD Y8, Y11, Y2
	VFMADD231PD Y9, Y11, Y3
	VCVTPS2PD (R10)(AX*4), Y12
	VCVTPS2PD (R11)(AX*4), Y13
	VFMADD231PD Y8, Y12, Y4
	VFMADD231PD Y9, Y12, Y5
	VFMADD231PD Y8, Y13, Y6
	VFMADD231PD Y9, Y13, Y7
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  panel4loop2
	RED4(Y0, Y2, Y4, Y6, Y8)
	RED4(Y1, Y3, Y5, Y7, Y9)
	ROUND32(Y0, X8, panel4r0)
	ROUND32(Y1, X9, panel4r1)
	VMOVUPD Y0, (R8)
	VMOVUPD Y1, (R8)(R14*1)
	LEAQ (R8)(R14*2), R8
	LEAQ (DI)(DX*2), DI
	SUBQ $2, R13
	JMP  panel4pair
panel4single:
	TESTQ R13, R13
	JZ   panel4done
	VXORPD Y0, Y0, Y0
	VXORPD Y1, Y1, Y1
	VXORPD Y2, Y2, Y2
	VXORPD Y3, Y3, Y3
	XORQ AX, AX
panel4loop1:
	VMOVUPD   (DI)(AX*8), Y8
	VCVTPS2PD (SI)(AX*4), Y10
	VCVTPS2PD (R9)(AX*4), Y11
	VCVTPS2PD (R10)(AX*4), Y12
	VCVTPS2PD (R11)(AX*4), Y13
	VFMADD231PD Y8, Y10, Y0
	VFMADD231PD Y8, Y11, Y1
	VFMADD231PD Y8, Y12, Y2
	VFMADD231PD Y8, Y13, Y3
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  panel4loop1
	RED4(Y0, Y1, Y2, Y3, Y8)
	ROUND32(Y0, X8, panel4r2)
	VMOVUPD Y0, (R8)
panel4done:
	VZEROUPPER
	RET

// func panel8(w *float32, k int, x *float64, out *float64, round int)
// out[r] = dot(w[r*k:][:k], x[:k]) for the eight rows r < 8, rounded to
// float32 if round != 0. k%4 == 0, k > 0. One token: eight chains of
// multiply-adds keep the units busy where panel4 would have four.
TEXT ·panel8(SB), NOSPLIT, $0-40
	MOVQ w+0(FP), SI
	MOVQ k+8(FP), CX
	MOVQ x+16(FP), DI
	MOVQ out+24(FP), R8
	MOVQ round+32(FP), R15
	MOVQ CX, BX
	SHLQ $2, BX
	LEAQ (SI)(BX*1), R9
	LEAQ (R9)(BX*1), R10
	LEAQ (R10)(BX*1), R11
	LEAQ (R11)(BX*1), R12
	LEAQ (R12)(BX*1), R13
	LEAQ (R13)(BX*1), R14
	LEAQ (R14)(BX*1), DX
	VXORPD Y0, Y0, Y0
	VXORPD Y1, Y1, Y1
	VXORPD Y2, Y2, Y2
	VXORPD Y3, Y3, Y3
	VXORPD Y4, Y4, Y4
	VXORPD Y5, Y5, Y5
	VXORPD Y6, Y6, Y6
	VXORPD Y7, Y7, Y7
	XORQ AX, AX
panel8loop:
	VMOVUPD   (DI)(AX*8), Y8
	VCVTPS2PD (SI)(AX*4), Y10
	VCVTPS2PD (R9)(AX*4), Y11
	VCVTPS2PD (R10)(AX*4), Y12
	VCVTPS2PD (R11)(AX*4), Y13
	VFMADD231PD Y8, Y10, Y0
	VFMADD231PD Y8, Y11, Y1
	VFMADD231PD Y8, Y12, Y2
	VFMADD231PD Y8, Y13, Y3
	VCVTPS2PD (R12)(AX*4), Y10
	VCVTPS2PD (R13)(AX*4), Y11
	VCVTPS2PD (R14)(AX*4), Y12
	VCVTPS2PD (DX)(AX*4), Y13
	VFMADD231PD Y8, Y10, Y4
	VFMADD231PD Y8, Y11, Y5
	VFMADD231PD Y8, Y12, Y6
	VFMADD231PD Y8, Y13, Y7
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  panel8loop
	RED4(Y0, Y1, Y2, Y3, Y8)
	RED4(Y4, Y5, Y6, Y7, Y9)
	ROUND32(Y0, X8, panel8r0)
	ROUND32(Y4, X9, panel8r1)
	VMOVUPD Y0, (R8)
	VMOVUPD Y4, 32(R8)
	VZEROUPPER
	RET

// func wsum32(acc *float64, p *float64, n int, v *float32, vs int)
// acc[d] += float64(p[j]·v[j*vs+d]) for j < n in order, d < 32: the
// product rounded, then added (no fused multiply-add: p is not a float32).
TEXT ·wsum32(SB), NOSPLIT, $0-40
	MOVQ acc+0(FP), R8
	MOVQ p+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ v+24(FP), DI
	MOVQ vs+32(FP), BX
	SHLQ $2, BX
	VMOVUPD 0(R8), Y0
	VMOVUPD 32(R8), Y1
	VMOVUPD 64(R8), Y2
	VMOVUPD 96(R8), Y3
	VMOVUPD 128(R8), Y4
	VMOVUPD 160(R8), Y5
	VMOVUPD 192(R8), Y6
	VMOVUPD 224(R8), Y7
	XORQ AX, AX
	CMPQ AX, CX
	JGE  wsum32done
wsum32loop:
	VBROADCASTSD (SI)(AX*8), Y8
	VCVTPS2PD 0(DI), Y9
	VCVTPS2PD 16(DI), Y10
	VCVTPS2PD 32(DI), Y11
	VCVTPS2PD 48(DI), Y12
	VMULPD Y8, Y9, Y9
	VMULPD Y8, Y10, Y10
	VMULPD Y8, Y11, Y11
	VMULPD Y8, Y12, Y12
	VADDPD Y9, Y0, Y0
	VADDPD Y10, Y1, Y1
	VADDPD Y11, Y2, Y2
	VADDPD Y12, Y3, Y3
	VCVTPS2PD 64(DI), Y9
	VCVTPS2PD 80(DI), Y10
	VCVTPS2PD 96(DI), Y11
	VCVTPS2PD 112(DI), Y12
	VMULPD Y8, Y9, Y9
	VMULPD Y8, Y10, Y10
	VMULPD Y8, Y11, Y11
	VMULPD Y8, Y12, Y12
	VADDPD Y9, Y4, Y4
	VADDPD Y10, Y5, Y5
	VADDPD Y11, Y6, Y6
	VADDPD Y12, Y7, Y7
	ADDQ BX, DI
	INCQ AX
	CMPQ AX, CX
	JLT  wsum32loop
wsum32done:
	VMOVUPD Y0, 0(R8)
	VMOVUPD Y1, 32(R8)
	VMOVUPD Y2, 64(R8)
	VMOVUPD Y3, 96(R8)
	VMOVUPD Y4, 128(R8)
	VMOVUPD Y5, 160(R8)
	VMOVUPD Y6, 192(R8)
	VMOVUPD Y7, 224(R8)
	VZEROUPPER
	RET

// func wsum64(acc *float64, p *float64, n int, v *float64, vs int)
// wsum32 with float64 rows: acc[d] += float64(p[j]·v[j*vs+d]) for j < n
// in order, d < 32.
TEXT ·wsum64(SB), NOSPLIT, $0-40
	MOVQ acc+0(FP), R8
	MOVQ p+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ v+24(FP), DI
	MOVQ vs+32(FP), BX
	SHLQ $3, BX
	VMOVUPD 0(R8), Y0
	VMOVUPD 32(R8), Y1
	VMOVUPD 64(R8), Y2
	VMOVUPD 96(R8), Y3
	VMOVUPD 128(R8), Y4
	VMOVUPD 160(R8), Y5
	VMOVUPD 192(R8), Y6
	VMOVUPD 224(R8), Y7
	XORQ AX, AX
	CMPQ AX, CX
	JGE  wsum64done
wsum64loop:
	VBROADCASTSD (SI)(AX*8), Y8
	VMULPD 0(DI), Y8, Y9
	VMULPD 32(DI), Y8, Y10
	VMULPD 64(DI), Y8, Y11
	VMULPD 96(DI), Y8, Y12
	VADDPD Y9, Y0, Y0
	VADDPD Y10, Y1, Y1
	VADDPD Y11, Y2, Y2
	VADDPD Y12, Y3, Y3
	VMULPD 128(DI), Y8, Y9
	VMULPD 160(DI), Y8, Y10
	VMULPD 192(DI), Y8, Y11
	VMULPD 224(DI), Y8, Y12
	VADDPD Y9, Y4, Y4
	VADDPD Y10, Y5, Y5
	VADDPD Y11, Y6, Y6
	VADDPD Y12, Y7, Y7
	ADDQ BX, DI
	INCQ AX
	CMPQ AX, CX
	JLT  wsum64loop
wsum64done:
	VMOVUPD Y0, 0(R8)
	VMOVUPD Y1, 32(R8)
	VMOVUPD Y2, 64(R8)
	VMOVUPD Y3, 96(R8)
	VMOVUPD Y4, 128(R8)
	VMOVUPD Y5, 160(R8)
	VMOVUPD Y6, 192(R8)
	VMOVUPD Y7, 224(R8)
	VZEROUPPER
	RET

// func cpuid(eaxArg, ecxArg uint32) (eax, ebx, ecx, edx uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL eaxArg+0(FP), AX
	MOVL ecxArg+4(FP), CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL BX, ebx+12(FP)
	MOVL CX, ecx+16(FP)
	MOVL DX, edx+20(FP)
	RET

// func xgetbv() (eax, edx uint32)
TEXT ·xgetbv(SB), NOSPLIT, $0-8
	MOVL $0, CX
	XGETBV
	MOVL AX, eax+0(FP)
	MOVL DX, edx+4(FP)
	RET

// func scaleMax(s *float64, n int, f float64) (m float64)
// s[j] *= f for j < n (n%4 == 0, n > 0); returns the largest product.
TEXT ·scaleMax(SB), NOSPLIT, $0-32
	MOVQ s+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD f+16(FP), Y1
	VMOVUPD (SI), Y0
	VMULPD  Y1, Y0, Y0
	VMOVUPD Y0, (SI)
	MOVQ $4, AX
	CMPQ AX, CX
	JGE  scaleMaxDone
scaleMaxLoop:
	VMOVUPD (SI)(AX*8), Y2
	VMULPD  Y1, Y2, Y2
	VMOVUPD Y2, (SI)(AX*8)
	VMAXPD  Y2, Y0, Y0
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  scaleMaxLoop
scaleMaxDone:
	VEXTRACTF128 $1, Y0, X2
	VMAXPD  X2, X0, X0
	VUNPCKHPD X0, X0, X2
	VMAXSD  X2, X0, X0
	VMOVSD  X0, m+24(FP)
	VZEROUPPER
	RET

// func mulScalar(s *float64, n int, f float64)
// s[j] *= f for j < n (n%4 == 0).
TEXT ·mulScalar(SB), NOSPLIT, $0-24
	MOVQ s+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD f+16(FP), Y1
	XORQ AX, AX
	CMPQ AX, CX
	JGE  mulScalarDone
mulScalarLoop:
	VMOVUPD (SI)(AX*8), Y2
	VMULPD  Y1, Y2, Y2
	VMOVUPD Y2, (SI)(AX*8)
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  mulScalarLoop
mulScalarDone:
	VZEROUPPER
	RET

// The constants of expKernel (kernels.go), in its order of use.
DATA expconst<>+0(SB)/8, $1.4426950408889634073599246810018920
DATA expconst<>+8(SB)/8, $0.69314718055966295651160180568695068359375
DATA expconst<>+16(SB)/8, $0.28235290563031577122588448175013436025525412068e-12
DATA expconst<>+24(SB)/8, $0.0625
DATA expconst<>+32(SB)/8, $2.4801587301587301587e-5
DATA expconst<>+40(SB)/8, $1.9841269841269841270e-4
DATA expconst<>+48(SB)/8, $1.3888888888888888889e-3
DATA expconst<>+56(SB)/8, $8.3333333333333333333e-3
DATA expconst<>+64(SB)/8, $4.1666666666666666667e-2
DATA expconst<>+72(SB)/8, $1.6666666666666666667e-1
DATA expconst<>+80(SB)/8, $0.5
DATA expconst<>+88(SB)/8, $1.0
DATA expconst<>+96(SB)/8, $2.0
DATA expconst<>+104(SB)/8, $-700.0
DATA expconst<>+112(SB)/8, $1023
DATA expconst<>+120(SB)/8, $700.0
GLOBL expconst<>(SB), RODATA, $128

// func expSum(s *float64, n int, m, sum float64) (done int, total float64)
// For j < n (n%4 == 0), four at a time: s[j] = expKernel(s[j]-m) and
// sum += s[j], one after another in order of j. It stops before the first
// group of four with an argument outside [-700, 0] (or NaN), which the
// caller computes with expKernel, and returns how far it got and the sum.
// Each lane runs expKernel's operations in its order, fused where it
// fuses.
TEXT ·expSum(SB), NOSPLIT, $0-48
	MOVQ s+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD m+16(FP), Y15
	VMOVSD sum+24(FP), X14
	VBROADCASTSD expconst<>+104(SB), Y13 // -700
	VXORPD Y12, Y12, Y12                  // 0
	VBROADCASTSD expconst<>+96(SB), Y11   // 2
	VBROADCASTSD expconst<>+88(SB), Y10   // 1
	XORQ AX, AX
	CMPQ AX, CX
	JGE  expSumDone
expSumLoop:
	VMOVUPD (SI)(AX*8), Y0
	VSUBPD  Y15, Y0, Y0          // x = s - m
	VCMPPD  $0x1d, Y13, Y0, Y1   // x >= -700
	VCMPPD  $0x12, Y12, Y0, Y2   // x <= 0
	VANDPD  Y2, Y1, Y1
	VMOVMSKPD Y1, DX
	CMPQ DX, $15
	JNE  expSumDone
	VBROADCASTSD expconst<>+0(SB), Y1
	VMULPD  Y1, Y0, Y1           // t = x·log2(e)
	VCVTPD2DQY Y1, X2            // k = round(t), as CVTSD2SL
	VCVTDQ2PD X2, Y3             // float64(k)
	VBROADCASTSD expconst<>+8(SB), Y4
	VFNMADD231PD Y4, Y3, Y0      // x -= k·ln2 (upper), fused
	VBROADCASTSD expconst<>+16(SB), Y4
	VFNMADD231PD Y4, Y3, Y0      // x -= k·ln2 (lower), fused
	VBROADCASTSD expconst<>+24(SB), Y4
	VMULPD  Y4, Y0, Y0           // x /= 16
	VBROADCASTSD expconst<>+32(SB), Y5
	VBROADCASTSD expconst<>+40(SB), Y4
	VFMADD213PD Y4, Y0, Y5       // p = p·x + c
	VBROADCASTSD expconst<>+48(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+56(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+64(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+72(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+80(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VFMADD213PD Y10, Y0, Y5
	VMULPD  Y5, Y0, Y0           // x = x·p
	VADDPD  Y11, Y0, Y6          // x = x·(x+2), three times
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VFMADD213PD Y10, Y6, Y0      // x = x·(x+2) + 1, fused
	VPMOVSXDQ X2, Y3             // 2^k: (k+1023) << 52
	VPBROADCASTQ expconst<>+112(SB), Y4
	VPADDQ  Y4, Y3, Y3
	VPSLLQ  $52, Y3, Y3
	VMULPD  Y3, Y0, Y0
	VMOVUPD Y0, (SI)(AX*8)
	VADDSD  X0, X14, X14         // the sum, in order
	VUNPCKHPD X0, X0, X1
	VADDSD  X1, X14, X14
	VEXTRACTF128 $1, Y0, X0
	VADDSD  X0, X14, X14
	VUNPCKHPD X0, X0, X1
	VADDSD  X1, X14, X14
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  expSumLoop
expSumDone:
	MOVQ AX, done+32(FP)
	VMOVSD X14, total+40(FP)
	VZEROUPPER
	RET

// func expVec(s *float64, n int) (done int)
// s[j] = expKernel(s[j]) for j < n (n%4 == 0), four at a time, with
// expSum's operations. It stops before the first group of four with an
// argument outside [-700, 700] (or NaN), which the caller computes with
// expKernel, and returns how far it got.
TEXT ·expVec(SB), NOSPLIT, $0-24
	MOVQ s+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD expconst<>+104(SB), Y13 // -700
	VBROADCASTSD expconst<>+120(SB), Y12 // 700
	VBROADCASTSD expconst<>+96(SB), Y11  // 2
	VBROADCASTSD expconst<>+88(SB), Y10  // 1
	XORQ AX, AX
	CMPQ AX, CX
	JGE  expVecDone
expVecLoop:
	VMOVUPD (SI)(AX*8), Y0
	VCMPPD  $0x1d, Y13, Y0, Y1   // x >= -700
	VCMPPD  $0x12, Y12, Y0, Y2   // x <= 700
	VANDPD  Y2, Y1, Y1
	VMOVMSKPD Y1, DX
	CMPQ DX, $15
	JNE  expVecDone
	VBROADCASTSD expconst<>+0(SB), Y1
	VMULPD  Y1, Y0, Y1           // t = x·log2(e)
	VCVTPD2DQY Y1, X2            // k = round(t), as CVTSD2SL
	VCVTDQ2PD X2, Y3             // float64(k)
	VBROADCASTSD expconst<>+8(SB), Y4
	VFNMADD231PD Y4, Y3, Y0      // x -= k·ln2 (upper), fused
	VBROADCASTSD expconst<>+16(SB), Y4
	VFNMADD231PD Y4, Y3, Y0      // x -= k·ln2 (lower), fused
	VBROADCASTSD expconst<>+24(SB), Y4
	VMULPD  Y4, Y0, Y0           // x /= 16
	VBROADCASTSD expconst<>+32(SB), Y5
	VBROADCASTSD expconst<>+40(SB), Y4
	VFMADD213PD Y4, Y0, Y5       // p = p·x + c
	VBROADCASTSD expconst<>+48(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+56(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+64(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+72(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VBROADCASTSD expconst<>+80(SB), Y4
	VFMADD213PD Y4, Y0, Y5
	VFMADD213PD Y10, Y0, Y5
	VMULPD  Y5, Y0, Y0           // x = x·p
	VADDPD  Y11, Y0, Y6          // x = x·(x+2), three times
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VMULPD  Y6, Y0, Y0
	VADDPD  Y11, Y0, Y6
	VFMADD213PD Y10, Y6, Y0      // x = x·(x+2) + 1, fused
	VPMOVSXDQ X2, Y3             // 2^k: (k+1023) << 52
	VPBROADCASTQ expconst<>+112(SB), Y4
	VPADDQ  Y4, Y3, Y3
	VPSLLQ  $52, Y3, Y3
	VMULPD  Y3, Y0, Y0
	VMOVUPD Y0, (SI)(AX*8)
	ADDQ $4, AX
	CMPQ AX, CX
	JLT  expVecLoop
expVecDone:
	MOVQ AX, done+16(FP)
	VZEROUPPER
	RET

// func bf16ToF32(dst *float32, src *byte, n int)
// dst[i] = the float32 of the little-endian bf16 at src[2i:], for i < n
// (n%8 == 0): the 16 bits shifted into the top of the float32.
TEXT ·bf16ToF32(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	XORQ AX, AX
	CMPQ AX, CX
	JGE  bf16done
bf16loop:
	VPMOVZXWD (SI)(AX*2), Y0
	VPSLLD    $16, Y0, Y0
	VMOVDQU   Y0, (DI)(AX*4)
	ADDQ $8, AX
	CMPQ AX, CX
	JLT  bf16loop
bf16done:
	VZEROUPPER
	RET
