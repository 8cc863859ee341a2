package memcopy

// Stream copies min(len(dst), len(src)) bytes from src to dst, as copy()
// does, and returns the count. Where the machine has them (amd64) the bulk
// is written with non-temporal stores, which bypass the caches; elsewhere
// it is copy(). The slices must not overlap. Stores are ordered before
// Stream returns, so any goroutine that synchronises with the caller
// afterwards sees the bytes.
func Stream(dst, src []byte) int {
	n := min(len(dst), len(src))
	if n == 0 {
		return 0
	}
	// Copy the head with copy() until dst is 16-byte aligned, the bulk in
	// 64-byte units with non-temporal stores, the tail with copy().
	head := min(n, headLen(&dst[0]))
	copy(dst[:head], src[:head])
	bulk := (n - head) &^ 63
	if bulk > 0 {
		streamBulk(&dst[head], &src[head], bulk)
	}
	copy(dst[head+bulk:n], src[head+bulk:n])
	return n
}
