//go:build !amd64

package memcopy

import "unsafe"

func headLen(*byte) int { return 0 }

// bulkFunc is the signature of the bulk loop (see stream_amd64.go).
type bulkFunc = func(dst, src *byte, n int, next *byte, nextN, dist int)

// bulk is copy(): no non-temporal stores here.
var bulk bulkFunc = copyBulk

func copyBulk(dst, src *byte, n int, _ *byte, _, _ int) {
	copy(unsafe.Slice(dst, n), unsafe.Slice(src, n))
}

func bulkVariants() map[string]bulkFunc { return map[string]bulkFunc{"copy": copyBulk} }

// Fence orders the stores of StreamSpan; copy() needs no fence.
func Fence() {}

// align is the alignment StreamSpan gives the bulk loop's destination: none.
const align = 1
