package layout

import "github.com/kvxfer/kvxfer/internal/memcopy"

// streams reports whether Pack or Unpack moving total bytes in the given
// spans copies them with memcopy.StreamSpan rather than copy(). Past what the caches
// hold (memcopy.StreamMin), a copy() per span of a few KiB is slow twice
// over: it writes through the caches, so every destination line is first
// read from memory (a read for ownership), and each span's first lines miss
// while the hardware prefetcher, which stops at page boundaries, trains on
// the new stream. StreamSpan writes with non-temporal stores and prefetches
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
