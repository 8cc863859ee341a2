//go:build race

package tcp

import (
	"runtime"
	"unsafe"
)

// raceWritten tells the race detector that the first n bytes of bufs were
// written (by the kernel, in a readv it cannot see), as the standard
// library's Read does for its buffer.
func raceWritten(bufs [][]byte, n int) {
	for _, b := range bufs {
		if n == 0 {
			return
		}
		k := min(n, len(b))
		if k > 0 {
			runtime.RaceWriteRange(unsafe.Pointer(&b[0]), k)
		}
		n -= k
	}
}
