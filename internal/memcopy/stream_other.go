//go:build !amd64

package memcopy

import "unsafe"

func headLen(*byte) int { return 0 }

func streamBulk(dst, src *byte, n int, _ *byte, _, _ int) {
	copy(unsafe.Slice(dst, n), unsafe.Slice(src, n))
}

// Fence orders the stores of StreamSpan; copy() needs no fence.
func Fence() {}
