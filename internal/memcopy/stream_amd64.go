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

// bulkFunc is the signature of the bulk loops: copy n bytes, a multiple
// of 128, from src to dst (align-byte aligned) with non-temporal stores,
// prefetching dist bytes ahead: within src first, then into the nextN bytes
// at next. They do not fence.
type bulkFunc = func(dst, src *byte, n int, next *byte, nextN, dist int)

// bulk is the loop StreamSpan runs: the AVX one where the processor has AVX
// (as Go's own copy() checks), else the SSE2 one, which every amd64
// processor has. Tests set it to each of bulkVariants in turn.
var bulk = pickBulk()

func pickBulk() bulkFunc {
	if cpu.X86.HasAVX {
		return streamBulkAVX
	}
	return streamBulkSSE
}

// bulkVariants lists the loops this processor can run, by name.
func bulkVariants() map[string]bulkFunc {
	v := map[string]bulkFunc{"sse2": streamBulkSSE}
	if cpu.X86.HasAVX {
		v["avx"] = streamBulkAVX
	}
	return v
}

//go:noescape
func streamBulkSSE(dst, src *byte, n int, next *byte, nextN, dist int)

//go:noescape
func streamBulkAVX(dst, src *byte, n int, next *byte, nextN, dist int)

// Fence orders every non-temporal store issued before it (by StreamSpan)
// before any store after it (SFENCE). Call it once after the last
// StreamSpan of an operation, before the bytes are handed to anyone.
func Fence()
