package layout

import "github.com/kvxfer/kvxfer/internal/memcopy"

// maxPrefetch bounds how far ahead of its copy copySpan prefetches: one
// span of the Llama shapes' 8 KiB and 32 KiB (measured best at a distance of
// one span), far enough for the memory's latency and near enough that the
// lines are still in L2 when the copy gets there.
const maxPrefetch = 32 << 10

// streams reports whether Pack or Unpack moving total bytes in the given
// spans copies them with copySpan rather than copy(). Past what the caches
// hold (memcopy.StreamMin), a copy() per span of a few KiB is slow twice
// over: it writes through the caches, so every destination line is first
// read from memory (a read for ownership), and each span's first lines miss
// while the hardware prefetcher, which stops at page boundaries, trains on
// the new stream. copySpan writes with non-temporal stores and prefetches
// the next span while it copies this one. Go's copy() itself switches to
// non-temporal stores from memcopy.StreamMin, so a plan with a span that
// long keeps copy(). Below that total, copy(), so that a small chunk stays
// in cache for whoever reads it next.
func streams(total int, spans []Span) bool {
	if total < memcopy.StreamMin {
		return false
	}
	for _, r := range spans {
		if r.Len >= memcopy.StreamMin {
			return false
		}
	}
	return true
}

// copySpan copies src to dst (of the same length) with non-temporal stores
// where the machine has them (amd64; elsewhere copy()), prefetching up to
// maxPrefetch bytes ahead: in src, then in next, the bytes that will be
// copied after these. It does not fence; the caller calls fence() after its
// last copySpan, before it returns.
func copySpan(dst, src, next []byte) {
	n := len(src)
	if n == 0 {
		return
	}
	// The head with copy() until dst is 16-byte aligned, the bulk in
	// 128-byte units with non-temporal stores, the tail with copy().
	head := min(n, alignHead(&dst[0]))
	copy(dst[:head], src[:head])
	bulk := (n - head) &^ 127
	if bulk > 0 {
		var np *byte
		if len(next) > 0 {
			np = &next[0]
		}
		copyBulk(&dst[head], &src[head], bulk, np, len(next), min(n, maxPrefetch))
	}
	copy(dst[head+bulk:n], src[head+bulk:n])
}
