package layout

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/internal/memcopy"
)

// TestCopySpanEqualsCopy checks copySpan against copy() for every head
// misalignment of dst and src, lengths around the 128-byte unit and the
// prefetch distance, and next regions absent, short and long: the bytes
// copied, and the bytes around dst and all of src and next, which must
// stay as they were.
func TestCopySpanEqualsCopy(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const size = 3*maxPrefetch + 256
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	orig := bytes.Clone(src)
	lengths := []int{0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 1000, 4096, maxPrefetch - 1, maxPrefetch + 65, 2*maxPrefetch + 3}
	for dOff := range 17 {
		for sOff := range 17 {
			for _, n := range lengths {
				for _, nextLen := range []int{0, 1, 100, maxPrefetch} {
					next := src[size-nextLen:]
					want := bytes.Repeat([]byte{0xa5}, size)
					got := bytes.Clone(want)
					copy(want[dOff:dOff+n], src[sOff:sOff+n])
					copySpan(got[dOff:dOff+n], src[sOff:sOff+n], next)
					fence()
					if !bytes.Equal(got, want) {
						t.Fatalf("dst+%d src+%d n=%d next=%d: copySpan differs from copy", dOff, sOff, n, nextLen)
					}
				}
			}
		}
	}
	if !bytes.Equal(src, orig) {
		t.Fatal("copySpan wrote to its source or next")
	}
}

func FuzzCopySpan(f *testing.F) {
	f.Add(bytes.Repeat([]byte("some bytes to copy, "), 20), uint8(3), uint8(5), uint16(7))
	f.Add([]byte{}, uint8(0), uint8(0), uint16(0))
	f.Fuzz(func(t *testing.T, data []byte, dOff, sOff uint8, nextLen uint16) {
		d, s := int(dOff%32), int(sOff%32)
		if s > len(data) {
			return
		}
		src := data[s:]
		next := data[:min(int(nextLen), len(data))]
		orig := bytes.Clone(data)
		want := make([]byte, d+len(src)+8)
		got := make([]byte, d+len(src)+8)
		copy(want[d:], src)
		copySpan(got[d:d+len(src)], src, next)
		fence()
		if !bytes.Equal(got, want) {
			t.Fatalf("copySpan(dst+%d, %d bytes, next %d bytes) differs from copy", d, len(src), len(next))
		}
		if !bytes.Equal(data, orig) {
			t.Fatal("copySpan wrote to its source")
		}
	})
}

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
// copy() and with copySpan: from and to consecutive pieces ("seq"), from
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
				fence()
			}
		})
	}
	copyFn := func(d, s, _ []byte) { copy(d, s) }
	spans("seq/copy", copyFn, 1, true)
	spans("seq/copySpan", copySpan, 1, true)
	spans("gather/copy", copyFn, 2, true)
	spans("gather/copySpan", copySpan, 2, true)
	spans("scatter/copy", copyFn, 2, false)
	spans("scatter/copySpan", copySpan, 2, false)
}
