package memcopy

import (
	"bytes"
	"math/rand/v2"
	"strconv"
	"testing"
)

// eachBulk runs test once with each bulk loop this processor has (useAVX
// set for it), as a subtest named for it.
func eachBulk(t *testing.T, test func(*testing.T)) {
	saved := useAVX
	t.Cleanup(func() { useAVX = saved })
	for name, v := range bulkVariants() {
		useAVX = v
		t.Run(name, test)
	}
}

// forEachBulk calls f with each bulk loop in turn (useAVX set for it, and
// restored after).
func forEachBulk(f func(name string)) {
	saved := useAVX
	defer func() { useAVX = saved }()
	for name, v := range bulkVariants() {
		useAVX = v
		f(name)
	}
}

// TestStreamKeepsSlicesOnStack checks that Stream's slices do not escape
// (the bulk loops are go:noescape, and an indirect call to them would
// lose that): buffers a caller keeps on its stack stay there.
func TestStreamKeepsSlicesOnStack(t *testing.T) {
	allocs := testing.AllocsPerRun(100, func() {
		var dst, src [512]byte
		src[7] = 1
		Stream(dst[:], src[:])
		if dst[7] != 1 {
			panic("Stream did not copy")
		}
	})
	if allocs != 0 {
		t.Fatalf("Stream of two stack buffers allocated %v times a call: its slices escape", allocs)
	}
}

// TestStreamEqualsCopy checks Stream against copy() for every head
// misalignment of dst and src and lengths around the 64-byte unit,
// including the bytes just outside the destination, which must stay.
func TestStreamEqualsCopy(t *testing.T) { eachBulk(t, testStreamEqualsCopy) }

func testStreamEqualsCopy(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	src := make([]byte, 4096+64)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	lengths := []int{0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 159, 160, 161, 1000, 4096}
	for dOff := range align + 1 {
		for sOff := range align + 1 {
			for _, n := range lengths {
				want := bytes.Repeat([]byte{0xa5}, 4096+64)
				got := bytes.Clone(want)
				wn := copy(want[dOff:dOff+n], src[sOff:sOff+n])
				gn := Stream(got[dOff:dOff+n], src[sOff:sOff+n])
				if gn != wn || !bytes.Equal(got, want) {
					t.Fatalf("dst+%d src+%d n=%d: Stream copied %d bytes, differs from copy (%d)", dOff, sOff, n, gn, wn)
				}
			}
		}
	}
}

func TestStreamShorterSide(t *testing.T) {
	src := bytes.Repeat([]byte{1}, 300)
	dst := make([]byte, 200)
	if n := Stream(dst, src); n != 200 || !bytes.Equal(dst, src[:200]) {
		t.Fatalf("Stream into a shorter dst copied %d bytes", n)
	}
	if n := Stream(make([]byte, 500), src); n != 300 {
		t.Fatalf("Stream from a shorter src copied %d bytes, want 300", n)
	}
}

func FuzzStream(f *testing.F) {
	f.Add([]byte("some bytes to copy, more than sixty-four of them, so the bulk loop runs once at least"), uint8(3), uint8(5))
	f.Fuzz(func(t *testing.T, data []byte, dOff, sOff uint8) {
		d, s := int(dOff%64), int(sOff%64)
		if s > len(data) {
			return
		}
		src := data[s:]
		want := make([]byte, d+len(src)+8)
		got := make([]byte, d+len(src)+8)
		copy(want[d:], src)
		forEachBulk(func(name string) {
			clear(got)
			Stream(got[d:d+len(src)], src)
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: Stream(dst+%d, %d bytes) differs from copy", name, d, len(src))
			}
		})
	})
}

// TestStreamSpanEqualsCopy checks StreamSpan against copy() for every head
// misalignment of dst and src, lengths around the 128-byte unit and the
// prefetch distance, and next regions absent, short and long: the bytes
// copied, and the bytes around dst and all of src and next, which must
// stay as they were.
func TestStreamSpanEqualsCopy(t *testing.T) { eachBulk(t, testStreamSpanEqualsCopy) }

func testStreamSpanEqualsCopy(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const size = 3*PrefetchMax + 256
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	orig := bytes.Clone(src)
	lengths := []int{0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 159, 160, 161, 191, 255, 256, 257, 1000, 4096, PrefetchMax - 1, PrefetchMax + 65, 2*PrefetchMax + 3}
	// The destination is the span plus dOff bytes before it and a guard
	// after it, all 0xa5: a write outside the span shows there.
	const guard = 256
	fill := bytes.Repeat([]byte{0xa5}, size)
	want, got := make([]byte, size), make([]byte, size)
	for dOff := range align + 1 {
		for sOff := range align + 1 {
			for _, n := range lengths {
				for _, nextLen := range []int{0, 1, 100, PrefetchMax} {
					next := src[size-nextLen:]
					end := min(size, dOff+n+guard)
					want, got := want[:end], got[:end]
					copy(want, fill)
					copy(got, fill)
					copy(want[dOff:dOff+n], src[sOff:sOff+n])
					StreamSpan(got[dOff:dOff+n], src[sOff:sOff+n], next)
					Fence()
					if !bytes.Equal(got, want) {
						t.Fatalf("dst+%d src+%d n=%d next=%d: StreamSpan differs from copy", dOff, sOff, n, nextLen)
					}
				}
			}
		}
	}
	if !bytes.Equal(src, orig) {
		t.Fatal("StreamSpan wrote to its source or next")
	}
}

func FuzzStreamSpan(f *testing.F) {
	f.Add(bytes.Repeat([]byte("some bytes to copy, "), 20), uint8(3), uint8(5), uint16(7))
	f.Add([]byte{}, uint8(0), uint8(0), uint16(0))
	f.Fuzz(func(t *testing.T, data []byte, dOff, sOff uint8, nextLen uint16) {
		d, s := int(dOff%64), int(sOff%64)
		if s > len(data) {
			return
		}
		src := data[s:]
		next := data[:min(int(nextLen), len(data))]
		orig := bytes.Clone(data)
		want := make([]byte, d+len(src)+8)
		got := make([]byte, d+len(src)+8)
		copy(want[d:], src)
		forEachBulk(func(name string) {
			clear(got)
			StreamSpan(got[d:d+len(src)], src, next)
			Fence()
			if !bytes.Equal(got, want) {
				t.Fatalf("%s: StreamSpan(dst+%d, %d bytes, next %d bytes) differs from copy", name, d, len(src), len(next))
			}
			if !bytes.Equal(data, orig) {
				t.Fatalf("%s: StreamSpan wrote to its source", name)
			}
		})
	})
}

// BenchmarkSpans copies 64 MiB in spans of 8 and 32 KiB, each taken from
// every other span of a 128 MiB source, into a contiguous destination, with
// copy() and with Stream through each bulk loop this processor has: the
// work of a Pack.
func BenchmarkSpans(b *testing.B) {
	const total = 64 << 20
	src, dst := make([]byte, 2*total), make([]byte, total)
	for i := range src {
		src[i] = byte(i)
	}
	for i := range dst {
		dst[i] = byte(i)
	}
	saved := useAVX
	defer func() { useAVX = saved }()
	run := func(name string, span int, f func(d, s []byte) int) {
		b.Run(name+"/span="+strconv.Itoa(span>>10)+"KiB", func(b *testing.B) {
			b.SetBytes(total)
			for b.Loop() {
				for off, o := 0, 0; off < total; off, o = off+span, o+2*span {
					f(dst[off:off+span], src[o:o+span])
				}
			}
		})
	}
	for _, span := range []int{8 << 10, 32 << 10} {
		run("copy", span, func(d, s []byte) int { return copy(d, s) })
		for name, v := range bulkVariants() {
			useAVX = v
			run("stream-"+name, span, Stream)
		}
	}
}
