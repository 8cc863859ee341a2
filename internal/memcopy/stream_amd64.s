#include "textflag.h"

// func streamBulkSSE(dst, src *byte, n int, next *byte, nextN, dist int)
//
// SSE2 (every amd64): unaligned 16-byte loads, aligned non-temporal 16-byte
// stores, 128 bytes a turn (measured 6% faster than 64 a turn for 8 KiB
// spans). With the 128 bytes at offset k it prefetches, into every cache
// level, the two lines at src+k+dist while k+dist < n, then those at
// next+(k+dist-n) while k+dist-n < nextN (the second line may lie past
// either end: a prefetch is a hint and cannot fault). It does not fence: the
// caller calls Fence once it has issued all its copies.
TEXT ·streamBulkSSE(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ next+24(FP), R8
	MOVQ nextN+32(FP), R9
	MOVQ dist+40(FP), R10
	XORQ BX, BX
	TESTQ CX, CX
	JZ   done

loop:
	LEAQ (BX)(R10*1), AX
	CMPQ AX, CX
	JAE  pfnext
	PREFETCHT0 (SI)(AX*1)
	PREFETCHT0 64(SI)(AX*1)
	JMP  copy

pfnext:
	SUBQ CX, AX
	CMPQ AX, R9
	JAE  copy
	PREFETCHT0 (R8)(AX*1)
	PREFETCHT0 64(R8)(AX*1)

copy:
	MOVOU  0(SI)(BX*1), X0
	MOVOU  16(SI)(BX*1), X1
	MOVOU  32(SI)(BX*1), X2
	MOVOU  48(SI)(BX*1), X3
	MOVOU  64(SI)(BX*1), X4
	MOVOU  80(SI)(BX*1), X5
	MOVOU  96(SI)(BX*1), X6
	MOVOU  112(SI)(BX*1), X7
	MOVNTO X0, 0(DI)(BX*1)
	MOVNTO X1, 16(DI)(BX*1)
	MOVNTO X2, 32(DI)(BX*1)
	MOVNTO X3, 48(DI)(BX*1)
	MOVNTO X4, 64(DI)(BX*1)
	MOVNTO X5, 80(DI)(BX*1)
	MOVNTO X6, 96(DI)(BX*1)
	MOVNTO X7, 112(DI)(BX*1)
	ADDQ   $128, BX
	CMPQ   BX, CX
	JB     loop

done:
	RET

// func streamBulkAVX(dst, src *byte, n int, next *byte, nextN, dist int)
//
// streamBulkSSE with AVX: unaligned 32-byte loads, aligned (32-byte)
// non-temporal 32-byte stores, the same 128 bytes a turn and the same
// prefetches; VZEROUPPER before it returns, so that SSE code after it pays
// no transition. Measured against the SSE loop in layout's benchmarks
// (Llama-3.1-8B, 4096 tokens, 8 and 32 KiB spans, December 2026): packs
// 0.68-0.77x of a copy() of the same bytes -> 0.75-0.86x, unpacks
// 0.86-0.88x -> 0.97-0.99x. A loop of its own, not a branch per turn in
// the SSE2 one: one loop with both, the branch chosen by an argument,
// measured lower in five alternated runs (ctxTP1-genTP2 pack-staged
// 0.77-1.00x, median 0.82x, against 0.87-0.89x).
TEXT ·streamBulkAVX(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ next+24(FP), R8
	MOVQ nextN+32(FP), R9
	MOVQ dist+40(FP), R10
	XORQ BX, BX
	TESTQ CX, CX
	JZ   adone

aloop:
	LEAQ (BX)(R10*1), AX
	CMPQ AX, CX
	JAE  apfnext
	PREFETCHT0 (SI)(AX*1)
	PREFETCHT0 64(SI)(AX*1)
	JMP  acopy

apfnext:
	SUBQ CX, AX
	CMPQ AX, R9
	JAE  acopy
	PREFETCHT0 (R8)(AX*1)
	PREFETCHT0 64(R8)(AX*1)

acopy:
	VMOVDQU  0(SI)(BX*1), Y0
	VMOVDQU  32(SI)(BX*1), Y1
	VMOVDQU  64(SI)(BX*1), Y2
	VMOVDQU  96(SI)(BX*1), Y3
	VMOVNTDQ Y0, 0(DI)(BX*1)
	VMOVNTDQ Y1, 32(DI)(BX*1)
	VMOVNTDQ Y2, 64(DI)(BX*1)
	VMOVNTDQ Y3, 96(DI)(BX*1)
	ADDQ   $128, BX
	CMPQ   BX, CX
	JB     aloop

adone:
	VZEROUPPER
	RET

// func Fence()
TEXT ·Fence(SB), NOSPLIT, $0-0
	SFENCE
	RET
