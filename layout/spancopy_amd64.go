package layout

import "unsafe"

// alignHead returns the bytes from p to the next 16-byte boundary: what
// copyBulk's aligned stores need copied first.
func alignHead(p *byte) int { return int(-uintptr(unsafe.Pointer(p)) & 15) }

// copyBulk copies n bytes, a multiple of 128, from src to dst (16-byte
// aligned) with non-temporal stores, prefetching dist bytes ahead: within
// src first, then into the nextN bytes at next. It does not fence.
//
//go:noescape
func copyBulk(dst, src *byte, n int, next *byte, nextN, dist int)

// fence orders every non-temporal store issued before it before any store
// after it (SFENCE).
func fence()
