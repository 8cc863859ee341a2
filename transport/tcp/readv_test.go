package tcp

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

// TestSkip checks skip against a naive reference: the bytes left after
// dropping n from the front of the buffers, in order.
func TestSkip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 2000 {
		bufs := make([][]byte, 1+rng.IntN(6))
		var all []byte
		for j := range bufs {
			bufs[j] = make([]byte, rng.IntN(5)) // empty ones among them
			for k := range bufs[j] {
				bufs[j][k] = byte(rng.Uint32())
			}
			all = append(all, bufs[j]...)
		}
		n := rng.IntN(len(all) + 1)
		got := bytes.Join(skip(bufs, n), nil)
		if !bytes.Equal(got, all[n:]) {
			t.Fatalf("case %d: skip %d of %d bytes: got %v, want %v", i, n, len(all), got, all[n:])
		}
	}
}

// TestScatterReads moves random bytes into receipts cut at random (many
// spans per frame, more than one readv takes among them, empty and
// one-byte spans, frames of every size), and checks them against the
// source: the receiver's vectored reads land every byte where it belongs.
func TestScatterReads(t *testing.T) {
	b := open(t, transport.Options{})
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 12 {
		frame := 64 * (1 + rng.IntN(8192)) // up to 512 KiB
		a := open(t, transport.Options{FrameBytes: frame, Streams: 1 + rng.IntN(3)})
		maxSpan := []int{2, 64, 4096, 40000}[i%4]
		n := 1 + rng.IntN(min(4<<20, 10000*maxSpan))
		src := make([]byte, n)
		for k := range src {
			src[k] = byte(rng.Uint32())
		}
		var dst [][]byte
		for left := n; left > 0; {
			k := min(left, rng.IntN(maxSpan))
			dst = append(dst, make([]byte, k))
			left -= k
		}
		t.Run(fmt.Sprintf("frame=%d/spans=%d", frame, len(dst)), func(t *testing.T) {
			move(t, a, b, [][]byte{src}, dst)
		})
		a.Close()
	}
}
