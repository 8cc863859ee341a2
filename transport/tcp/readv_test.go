package tcp

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

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

// TestLowatTrickle: a frame that arrives in bursts with pauses between
// them, so that its reader finds the socket empty and waits for more of it
// (raising SO_RCVLOWAT on Linux), ends with a burst smaller than what the
// reader waited for before; then an ABORT and a one-byte frame, each far
// smaller than any of those waits, must reach their receipts at once: a
// reader that kept its raised SO_RCVLOWAT for a header would wait for bytes
// that never come.
func TestLowatTrickle(t *testing.T) {
	b := open(t, transport.Options{})
	const n = 3<<20 + 1000
	src := make([]byte, n)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	dst := [][]byte{make([]byte, n)}
	r, _ := b.Expect(dst)
	aborted, _ := b.Expect([][]byte{make([]byte, 10)})
	one := [][]byte{make([]byte, 1)}
	last, _ := b.Expect(one)
	conn := rawConn(t, b, 61)
	msg := frame(tagOf(t, r), 0, src)
	prev := 0
	for _, cut := range []int{headerLen + 100<<10, headerLen + 2<<20 + 512<<10, headerLen + n - 300, len(msg)} {
		if _, err := conn.Write(msg[prev:cut]); err != nil {
			t.Fatal(err)
		}
		prev = cut
		time.Sleep(30 * time.Millisecond) // the reader finds the socket empty
	}
	within(t, 5*time.Second, "the trickled frame", func() { <-r.Done() })
	if r.Err() != nil || !bytes.Equal(dst[0], src) {
		t.Fatalf("trickled frame: Err = %v, bytes equal = %v", r.Err(), bytes.Equal(dst[0], src))
	}
	start := time.Now()
	conn.Write(header(frameHeader{typ: frameAbort, tag: tagOf(t, aborted)}))
	within(t, 5*time.Second, "the ABORT", func() { <-aborted.Done() })
	conn.Write(frame(tagOf(t, last), 0, []byte{7}))
	within(t, 5*time.Second, "the one-byte frame", func() { <-last.Done() })
	if d := time.Since(start); d > time.Second {
		t.Errorf("ABORT and one-byte frame took %v after the trickled frame", d)
	}
	if !errors.Is(aborted.Err(), transport.ErrAborted) || last.Err() != nil || one[0][0] != 7 {
		t.Errorf("after the trickled frame: ABORT %v, one-byte frame %v, %d", aborted.Err(), last.Err(), one[0][0])
	}
}
