//go:build cgo

package bench

// #include <string.h>
import "C"

import "unsafe"

// cMemcpy copies src into dst (of the same length) with the C library's
// memcpy, the copy baseline C code would use.
func cMemcpy(dst, src []byte) error {
	if len(src) > 0 {
		C.memcpy(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), C.size_t(len(src)))
	}
	return nil
}
