package memcopy

import "unsafe"

// headLen returns the bytes from p to the next 16-byte boundary: what
// streamBulk's aligned stores need copied first.
func headLen(p *byte) int { return int(-uintptr(unsafe.Pointer(p)) & 15) }

// streamBulk copies n bytes, a multiple of 128, from src to dst (16-byte
// aligned) with non-temporal stores, prefetching dist bytes ahead: within
// src first, then into the nextN bytes at next. It does not fence.
//
//go:noescape
func streamBulk(dst, src *byte, n int, next *byte, nextN, dist int)

// Fence orders every non-temporal store issued before it (by StreamSpan)
// before any store after it (SFENCE). Call it once after the last
// StreamSpan of an operation, before the bytes are handed to anyone.
func Fence()
