package memcopy

import "unsafe"

// headLen returns the bytes from p to the next 16-byte boundary.
func headLen(p *byte) int { return int(-uintptr(unsafe.Pointer(p)) & 15) }

// streamBulk copies n bytes, a multiple of 64, from src to dst (16-byte
// aligned) with non-temporal stores, then fences them.
//
//go:noescape
func streamBulk(dst, src *byte, n int)
