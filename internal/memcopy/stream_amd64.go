package memcopy

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// align is the alignment the bulk loops' stores need: 32 bytes for the AVX
// loop (the SSE one needs 16, which 32 gives too).
const align = 32

// headLen returns the bytes from p to the next align boundary: what
// the bulk loop's aligned stores need copied first.
func headLen(p *byte) int { return int(-uintptr(unsafe.Pointer(p)) & (align - 1)) }

// useAVX says which loop streamBulk runs: the AVX one where the processor
// has AVX (x/sys/cpu checks that the OS saves its registers too, as Go's own
// copy() does), else the SSE2 one, which every amd64 processor has. Tests
// set it to each of bulkVariants in turn. A variable rather than a function
// value, so that the loops' go:noescape reaches StreamSpan's callers: their
// slices do not escape through an indirect call.
var useAVX = cpu.X86.HasAVX

// bulkVariants maps each loop this processor can run, by name, to the
// useAVX that selects it.
func bulkVariants() map[string]bool {
	v := map[string]bool{"sse2": false}
	if cpu.X86.HasAVX {
		v["avx"] = true
	}
	return v
}

// streamBulk copies n bytes, a multiple of 128, from src to dst (align-byte
// aligned) with non-temporal stores, prefetching dist bytes ahead: within
// src first, then into the nextN bytes at next. It does not fence.
func streamBulk(dst, src *byte, n int, next *byte, nextN, dist int) {
	if useAVX {
		streamBulkAVX(dst, src, n, next, nextN, dist)
		return
	}
	streamBulkSSE(dst, src, n, next, nextN, dist)
}

//go:noescape
func streamBulkSSE(dst, src *byte, n int, next *byte, nextN, dist int)

//go:noescape
func streamBulkAVX(dst, src *byte, n int, next *byte, nextN, dist int)

// Fence orders every non-temporal store issued before it (by StreamSpan)
// before any store after it (SFENCE). Call it once after the last
// StreamSpan of an operation, before the bytes are handed to anyone.
func Fence()
