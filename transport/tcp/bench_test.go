package tcp

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

var benchSizes = []struct {
	name string
	n    int
}{
	{"64KiB", 64 << 10}, {"4MiB", 4 << 20}, {"512MiB", 512 << 20},
}

// BenchmarkSend moves one buffer per iteration from one Transport to
// another on loopback with the default options: Send, then wait for the
// receipt. Compare with BenchmarkRawTCP.
func BenchmarkSend(b *testing.B) { benchSend(b, transport.Options{}, transport.Options{}) }

// BenchmarkSendTLS is BenchmarkSend with mutual TLS on the data
// connections (TLS 1.3, AES-128-GCM on CPUs with AES instructions). Compare
// with BenchmarkSend and with `openssl speed -evp aes-128-gcm`, the cipher's
// limit on one core: each stream encrypts on one core and decrypts on
// another.
func BenchmarkSendTLS(b *testing.B) {
	benchSend(b, transport.Options{TLS: party(b, testCA(), "tx")}, transport.Options{TLS: party(b, testCA(), "rx")})
}

// BenchmarkSendShape is BenchmarkSend at 512 MiB with each number of
// streams and frame size worth trying on a small machine: the defaults
// (transport.DefaultStreams, DefaultFrameBytes) should win or tie.
func BenchmarkSendShape(b *testing.B) {
	for _, streams := range []int{1, 2, 4} {
		for _, frame := range []int{256 << 10, 1 << 20, 4 << 20} {
			b.Run(fmt.Sprintf("streams=%d/frame=%dKiB", streams, frame>>10), func(b *testing.B) {
				o := transport.Options{Streams: streams, FrameBytes: frame}
				benchSendSizes(b, o, transport.Options{}, benchSizes[len(benchSizes)-1:])
			})
		}
	}
}

func benchSend(b *testing.B, txOpts, rxOpts transport.Options) {
	benchSendSizes(b, txOpts, rxOpts, benchSizes)
}

func benchSendSizes(b *testing.B, txOpts, rxOpts transport.Options, sizes []struct {
	name string
	n    int
}) {
	for _, sz := range sizes {
		b.Run(sz.name, func(b *testing.B) {
			ctx := context.Background()
			tx, err := Open(ctx, txOpts)
			if err != nil {
				b.Fatal(err)
			}
			defer tx.Close()
			rx, err := Open(ctx, rxOpts)
			if err != nil {
				b.Fatal(err)
			}
			defer rx.Close()
			src := [][]byte{make([]byte, sz.n)}
			dst := [][]byte{make([]byte, sz.n)}
			move := func() {
				r, err := rx.Expect(dst)
				if err != nil {
					b.Fatal(err)
				}
				if err := tx.Send(ctx, r.Descriptor(), src); err != nil {
					b.Fatal(err)
				}
				<-r.Done()
				if err := r.Err(); err != nil {
					b.Fatal(err)
				}
			}
			move() // untimed: dial the streams, fault the pages in
			b.SetBytes(int64(sz.n))
			b.ReportAllocs()
			for b.Loop() {
				move()
			}
		})
	}
}

// BenchmarkRawTCP is the yardstick of BenchmarkSend: a minimal sender and
// receiver over one loopback TCP connection, moving the same bytes (one
// Write, one io.ReadFull, per iteration).
func BenchmarkRawTCP(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			out, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer out.Close()
			in, err := ln.Accept()
			if err != nil {
				b.Fatal(err)
			}
			defer in.Close()
			src := make([]byte, sz.n)
			dst := make([]byte, sz.n)
			next, done := make(chan struct{}), make(chan error)
			go func() {
				for range next {
					_, err := io.ReadFull(in, dst)
					done <- err
				}
			}()
			defer close(next)
			move := func() {
				next <- struct{}{}
				if _, err := out.Write(src); err != nil {
					b.Fatal(err)
				}
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			move() // untimed: fault the pages in, as BenchmarkSend does
			b.SetBytes(int64(sz.n))
			b.ReportAllocs()
			for b.Loop() {
				move()
			}
		})
	}
}
