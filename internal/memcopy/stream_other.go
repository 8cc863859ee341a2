//go:build !amd64

package memcopy

import "unsafe"

func headLen(*byte) int { return 0 }

// useAVX is unused here (tests set it).
var useAVX bool

func streamBulk(dst, src *byte, n int, _ *byte, _, _ int) {
	copy(unsafe.Slice(dst, n), unsafe.Slice(src, n))
}

// bulkVariants: one loop here, copy().
func bulkVariants() map[string]bool { return map[string]bool{"copy": false} }

// Fence orders the stores of StreamSpan; copy() needs no fence.
func Fence() {}

// align is the alignment StreamSpan gives the bulk loop's destination: none.
const align = 1
