package memcopy

// PrefetchMax bounds how far ahead of its copy StreamSpan prefetches: one
// span of the Llama shapes' 8 KiB and 32 KiB (measured best at a distance
// of one span), far enough for the memory's latency and near enough that
// the lines are still in L2 when the copy gets there.
const PrefetchMax = 32 << 10

// Stream copies min(len(dst), len(src)) bytes from src to dst, as copy()
// does, and returns the count. Where the machine has them (amd64) the bulk
// is written with non-temporal stores, which bypass the caches; elsewhere
// it is copy(). The slices must not overlap. Stores are ordered before
// Stream returns, so any goroutine that synchronises with the caller
// afterwards sees the bytes.
func Stream(dst, src []byte) int {
	n := StreamSpan(dst, src, nil)
	Fence()
	return n
}

// StreamSpan is Stream for one span of many: it prefetches up to
// PrefetchMax bytes ahead of its copy, in src, then in next (the bytes the
// caller copies after these; nil for none), so that the next span does not
// start cold, and it does not fence: the caller calls Fence after its last
// StreamSpan, before the bytes are handed on.
func StreamSpan(dst, src, next []byte) int {
	n := min(len(dst), len(src))
	if n == 0 {
		return 0
	}
	// The head with copy() until dst is 16-byte aligned, the bulk in
	// 128-byte units with non-temporal stores, the tail with copy().
	head := min(n, headLen(&dst[0]))
	copy(dst[:head], src[:head])
	bulk := (n - head) &^ 127
	if bulk > 0 {
		var np *byte
		if len(next) > 0 {
			np = &next[0]
		}
		streamBulk(&dst[head], &src[head], bulk, np, len(next), min(n, PrefetchMax))
	}
	copy(dst[head+bulk:n], src[head+bulk:n])
	return n
}
