package mpi

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

func TestDescRoundTrip(t *testing.T) {
	for _, d := range []desc{
		{Epoch: 1, Rank: 0, Transport: 1, Receipt: 1, Total: 1},
		{Epoch: ^uint64(0), Rank: 1<<31 - 1, Transport: ^uint32(0), Receipt: ^uint64(0), Total: 1<<62 + 3},
		{Epoch: 42, Rank: 7, Transport: 3, Receipt: 99, Total: 64 << 20},
	} {
		b := d.encode()
		if len(b) != descLen {
			t.Fatalf("encode(%+v): %d bytes, want %d", d, len(b), descLen)
		}
		got, err := decodeDesc(b)
		if err != nil || got != d {
			t.Errorf("decodeDesc(encode(%+v)) = %+v, %v", d, got, err)
		}
	}
}

func TestDescRefused(t *testing.T) {
	good := desc{Epoch: 5, Rank: 1, Transport: 2, Receipt: 3, Total: 4096}.encode()
	flip := func(i int) []byte { b := bytes.Clone(good); b[i] ^= 1; return b }
	zeroTotal := desc{Epoch: 5, Rank: 1, Transport: 2, Receipt: 3, Total: 0}.encode()
	cases := map[string][]byte{
		"nil": nil, "short": good[:descLen-1], "long": append(bytes.Clone(good), 0),
		"magic": flip(0), "version": flip(4), "pad": flip(5), "epoch": flip(8), "rank": flip(16),
		"total": flip(32), "crc": flip(40), "zero total": zeroTotal,
	}
	for name, b := range cases {
		if _, err := decodeDesc(b); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("%s: decodeDesc = %v, want ErrBadDescriptor", name, err)
		}
	}
}

func TestCtlRoundTrip(t *testing.T) {
	for k := ctlRTS; k <= ctlCount; k++ {
		m := ctlMsg{Kind: k, Code: codeFin, Transport: 9, Receipt: 1 << 40, Send: 77, A: allFrames, B: 4 << 20}
		b := make([]byte, ctlLen)
		m.put(b)
		got, err := parseCtl(b)
		if err != nil || got != m {
			t.Errorf("parseCtl(put(%+v)) = %+v, %v", m, got, err)
		}
	}
	for name, b := range map[string][]byte{
		"short": make([]byte, ctlLen-1), "kind 0": make([]byte, ctlLen),
		"kind 9": append([]byte{9}, make([]byte, ctlLen-1)...), "code": append([]byte{1, 200}, make([]byte, ctlLen-2)...),
		"pad": append([]byte{1, 0, 1}, make([]byte, ctlLen-3)...),
	} {
		if _, err := parseCtl(b); !errors.Is(err, errCtl) {
			t.Errorf("%s: parseCtl = %v, want errCtl", name, err)
		}
	}
}

// naiveFrame is the reference: the bytes [off, off+n) of the pieces'
// concatenation, byte by byte.
func naiveFrame(pieces [][]byte, off int64, n int) []byte {
	var flat []byte
	for _, p := range pieces {
		flat = append(flat, p...)
	}
	return flat[off : off+int64(n)]
}

func TestFrameBlocksAgainstNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 500 {
		pieces := make([][]byte, 1+rng.IntN(8))
		var total int64
		for i := range pieces {
			pieces[i] = make([]byte, rng.IntN(50))
			for j := range pieces[i] {
				pieces[i][j] = byte(rng.Uint32())
			}
			total += int64(len(pieces[i]))
		}
		if total == 0 {
			continue
		}
		fb := 1 + rng.IntN(40)
		n := frameCount(total, fb)
		var covered int64
		for i := range n {
			off := int64(i) * int64(fb)
			ln := int(min(int64(fb), total-off))
			var got []byte
			for _, b := range frameBlocks(pieces, off, ln) {
				if b.Len <= 0 {
					t.Fatalf("empty block %+v", b)
				}
				got = append(got, pieces[b.Piece][b.Off:b.Off+b.Len]...)
			}
			if want := naiveFrame(pieces, off, ln); !bytes.Equal(got, want) {
				t.Fatalf("frame %d of %d (fb %d): got %v, want %v", i, n, fb, got, want)
			}
			covered += int64(ln)
		}
		if covered != total {
			t.Fatalf("frames cover %d bytes of %d", covered, total)
		}
	}
}

func FuzzDecodeDesc(f *testing.F) {
	f.Add([]byte(desc{Epoch: 5, Rank: 1, Transport: 2, Receipt: 3, Total: 4096}.encode()))
	f.Add([]byte("KXMP"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := decodeDesc(b)
		if err != nil {
			if !errors.Is(err, transport.ErrBadDescriptor) {
				t.Fatalf("error %v does not wrap ErrBadDescriptor", err)
			}
			return
		}
		if !bytes.Equal(d.encode(), b) {
			t.Fatalf("accepted %x, which re-encodes differently", b)
		}
	})
}

func FuzzParseCtl(f *testing.F) {
	b := make([]byte, ctlLen)
	ctlMsg{Kind: ctlCTS, Receipt: 1, Send: 2, A: 3, B: 4}.put(b)
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseCtl(b)
		if err != nil {
			return
		}
		out := make([]byte, ctlLen)
		m.put(out)
		if !bytes.Equal(out, b) {
			t.Fatalf("accepted %x, which re-encodes as %x", b, out)
		}
	})
}

// naiveMerge is mergeSpans's reference: it marks every byte address with
// the index of the span that holds it and cuts a new run wherever the next
// byte is not at the next address or the run would pass maxRun.
func naiveMerge(spans []span, maxRun int) []span {
	var out []span
	for _, s := range spans {
		for i := range s.Len {
			a := s.Addr + uintptr(i)
			if n := len(out); n > 0 && out[n-1].Addr+uintptr(out[n-1].Len) == a && out[n-1].Len < maxRun && (i > 0 || out[n-1].Len+s.Len <= maxRun) {
				out[n-1].Len++
				continue
			}
			out = append(out, span{Addr: a, Len: 1})
		}
	}
	return out
}

func TestMergeSpans(t *testing.T) {
	for _, tc := range []struct {
		name   string
		in     []span
		maxRun int
		want   []span
	}{
		{"empty", nil, 100, nil},
		{"one", []span{{100, 10}}, 100, []span{{100, 10}}},
		{"end to end", []span{{100, 10}, {110, 5}, {115, 1}}, 100, []span{{100, 16}}},
		{"gap", []span{{100, 10}, {111, 5}}, 100, []span{{100, 10}, {111, 5}}},
		{"backwards", []span{{110, 10}, {100, 10}}, 100, []span{{110, 10}, {100, 10}}},
		{"overlap is not end to end", []span{{100, 10}, {105, 10}}, 100, []span{{100, 10}, {105, 10}}},
		{"run bound", []span{{0, 60}, {60, 40}, {100, 1}}, 100, []span{{0, 100}, {100, 1}}},
		{"pool blocks", []span{{1 << 30, 4 << 20}, {1<<30 + 4<<20, 4 << 20}, {1<<30 + 8<<20, 4 << 20}, {1<<30 + 12<<20, 4 << 20}}, 1<<31 - 1, []span{{1 << 30, 16 << 20}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := mergeSpans(slices.Clone(tc.in), tc.maxRun)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("mergeSpans(%v, %d) = %v, want %v", tc.in, tc.maxRun, got, tc.want)
			}
		})
	}
}

// TestMergeSpansProperty: over random spans, some end to end, mergeSpans
// covers the same bytes in the same order, in runs that are each
// contiguous, within the bound, and no two of which could have been one
// (naiveMerge's runs, which cut only where they must).
func TestMergeSpansProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for range 2000 {
		n := rng.IntN(8)
		in := make([]span, n)
		at := uintptr(1000)
		for i := range in {
			switch rng.IntN(3) {
			case 0: // end to end with the last
			case 1:
				at += uintptr(1 + rng.IntN(5))
			default:
				at = uintptr(rng.IntN(2000))
			}
			in[i] = span{Addr: at, Len: 1 + rng.IntN(20)}
			at += uintptr(in[i].Len)
		}
		maxRun := 20 + rng.IntN(40)
		got := mergeSpans(slices.Clone(in), maxRun)
		if !slices.Equal(bytesOf(got), bytesOf(in)) {
			t.Fatalf("mergeSpans(%v) = %v: covers other bytes", in, got)
		}
		for _, s := range got {
			if s.Len > maxRun {
				t.Fatalf("mergeSpans(%v, %d) = %v: run %v passes the bound", in, maxRun, got, s)
			}
		}
		if want := naiveMerge(in, maxRun); len(got) != len(want) {
			t.Fatalf("mergeSpans(%v, %d) = %v (%d runs), reference %v (%d)", in, maxRun, got, len(got), want, len(want))
		}
	}
}

// bytesOf lists the addresses of every byte of spans, in order.
func bytesOf(spans []span) []uintptr {
	var out []uintptr
	for _, s := range spans {
		for i := range s.Len {
			out = append(out, s.Addr+uintptr(i))
		}
	}
	return out
}
