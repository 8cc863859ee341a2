package layout

import (
	"testing"

	"github.com/kvxfer/kvxfer/internal/memcopy"
)

func TestStreams(t *testing.T) {
	const m = memcopy.StreamMin
	for _, c := range []struct {
		total int
		spans []Span
		want  bool
	}{
		{m - 1, []Span{{0, 8 << 10}}, false},                 // fits in the caches: copy()
		{m, []Span{{0, 8 << 10}, {16 << 10, 8 << 10}}, true}, // short spans past StreamMin
		{m, nil, true},
		{4 * m, []Span{{0, 8 << 10}, {16 << 10, m}}, false}, // a span copy() already streams
		{4 * m, []Span{{0, m - 1}}, true},
	} {
		if got := streams(c.total, c.spans); got != c.want {
			t.Errorf("streams(%d, %v) = %t, want %t", c.total, c.spans, got, c.want)
		}
	}
}

// BenchmarkSpanCopy moves 64 MiB in one copy() and in 8 KiB pieces, with
// copy() and with memcopy.StreamSpan: from and to consecutive pieces ("seq"), from
// every other piece into consecutive ones (a Pack of context TP4 PP2 for
// generation TP8: "gather") and back ("scatter"). It separates what the
// destination's reads for ownership cost (seq) from what strided reading
// does (gather).
func BenchmarkSpanCopy(b *testing.B) {
	const total, span = 64 << 20, 8 << 10
	_, src := benchBlocks(1, 2*total)
	_, dst := benchBlocks(1, total)
	b.Run("one/copy", func(b *testing.B) {
		b.SetBytes(total)
		for b.Loop() {
			copy(dst, src[:total])
		}
	})
	spans := func(name string, f func(d, s, next []byte), stride int, gather bool) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(total)
			for b.Loop() {
				for off := 0; off < total; off += span {
					far := src[off*stride : off*stride+span]
					next := src[min(off*stride+stride*span, len(src)-span):][:span]
					if gather {
						f(dst[off:off+span], far, next)
					} else {
						f(far, dst[off:off+span], dst[off+span:])
					}
				}
				memcopy.Fence()
			}
		})
	}
	copyFn := func(d, s, _ []byte) { copy(d, s) }
	streamSpan := func(d, s, next []byte) { memcopy.StreamSpan(d, s, next) }
	spans("seq/copy", copyFn, 1, true)
	spans("seq/streamSpan", streamSpan, 1, true)
	spans("gather/copy", copyFn, 2, true)
	spans("gather/streamSpan", streamSpan, 2, true)
	spans("scatter/copy", copyFn, 2, false)
	spans("scatter/streamSpan", streamSpan, 2, false)
}
