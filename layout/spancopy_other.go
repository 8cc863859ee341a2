//go:build !amd64

package layout

import "unsafe"

func alignHead(*byte) int { return 0 }

func copyBulk(dst, src *byte, n int, _ *byte, _, _ int) {
	copy(unsafe.Slice(dst, n), unsafe.Slice(src, n))
}

func fence() {}
