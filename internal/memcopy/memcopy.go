package memcopy

// PrefetchMax bounds how far ahead of its copy StreamSpan prefetches: far
// enough for the memory's latency and near enough that the lines are still
// in L1 or L2 when the copy gets there. Measured in layout's benchmarks
// (Llama-3.1-8B spans of 8 and 32 KiB, December 2026) with the AVX loop,
// the two lowest packs in alternated runs: 4 KiB at 0.84-0.90x a copy()
// where 1 and 2 KiB gave 0.74-0.84x and 8 and 32 KiB 0.72-0.90x. Into every
// cache level (PREFETCHT0) rather than L2 they then gave 0.91-0.98x in two
// runs (non-temporal prefetches 0.88-0.94x, within the noise of it), and
// 0.81-1.15x (medians 0.89x and 0.94x) in five runs alternated with the
// SSE2 loop that prefetched 32 KiB ahead into L2, which gave 0.71-0.94x
// (docs/perf-notes.md).
const PrefetchMax = 4 << 10

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
	// The head with copy() until dst is aligned for the bulk loop, the bulk in
	// 128-byte units with non-temporal stores, the tail with copy().
	head := min(n, headLen(&dst[0]))
	copy(dst[:head], src[:head])
	nb := (n - head) &^ 127
	if nb > 0 {
		var np *byte
		if len(next) > 0 {
			np = &next[0]
		}
		streamBulk(&dst[head], &src[head], nb, np, len(next), min(nb, PrefetchMax))
	}
	copy(dst[head+nb:n], src[head+nb:n])
	return n
}
