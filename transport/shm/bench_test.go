//go:build linux

package shm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/memfd"
	"github.com/kvxfer/kvxfer/transport"
)

// BenchmarkSend moves one 512 MiB buffer per iteration between two
// Transports (Send, then wait for the receipt): "shm" with the default
// window (8 slots of 1 MiB), the others with the slot size and count they
// name. "copy" is the baseline in the same run: a plain copy between the
// same two buffers (memory files: 4 KiB pages). "copy-thp" and "shm-thp"
// are the same between two buffers in transparent huge pages, as
// RegisterMemory advises the pools.
func BenchmarkSend(b *testing.B) {
	const n = 512 << 20
	src, dst := benchArena(b, n), benchArena(b, n)
	for i, p := 0, src.Bytes(); i < len(p); i++ {
		p[i] = byte(i*7 + i>>12)
	}
	b.Run("copy", func(b *testing.B) {
		copy(dst.Bytes(), src.Bytes()) // untimed: fault the pages in
		b.SetBytes(n)
		for b.Loop() {
			copy(dst.Bytes(), src.Bytes())
		}
	})
	thpSrc, free1, err := alignedAnon(n, true)
	if err != nil {
		b.Fatal(err)
	}
	defer free1()
	thpDst, free2, err := alignedAnon(n, true)
	if err != nil {
		b.Fatal(err)
	}
	defer free2()
	copy(thpSrc, src.Bytes())
	copy(thpDst, src.Bytes()) // fault the pages in
	b.Run("copy-thp", func(b *testing.B) {
		b.SetBytes(n)
		for b.Loop() {
			copy(thpDst, thpSrc)
		}
	})
	b.Run("shm-thp", func(b *testing.B) {
		tx, rx := open(b, transport.Options{FrameBytes: 64 << 20}), open(b, transport.Options{})
		move := func() {
			r, err := rx.Expect([][]byte{thpDst})
			if err != nil {
				b.Fatal(err)
			}
			if err := tx.Send(context.Background(), r.Descriptor(), [][]byte{thpSrc}); err != nil {
				b.Fatal(err)
			}
			<-r.Done()
			if err := r.Err(); err != nil {
				b.Fatal(err)
			}
		}
		move()
		b.SetBytes(n)
		for b.Loop() {
			move()
		}
	})
	for _, sub := range []struct {
		name        string
		slot, slots int
	}{{"shm", 0, 0}, {"shm-256K-x32", 256 << 10, 32}, {"shm-128K-x64", 128 << 10, 64}, {"shm-512K-x16", 512 << 10, 16}, {"shm-2M-x4", 2 << 20, 4}} {
		b.Run(sub.name, func(b *testing.B) {
			if sub.slot > 0 {
				oldLen, oldSlots := maxSlotLen, windowSlots
				maxSlotLen, windowSlots = sub.slot, sub.slots
				defer func() { maxSlotLen, windowSlots = oldLen, oldSlots }()
			}
			tx, rx := open(b, transport.Options{FrameBytes: 64 << 20}), open(b, transport.Options{})
			ctx := context.Background()
			move := func() {
				r, err := rx.Expect([][]byte{dst.Bytes()})
				if err != nil {
					b.Fatal(err)
				}
				if err := tx.Send(ctx, r.Descriptor(), [][]byte{src.Bytes()}); err != nil {
					b.Fatal(err)
				}
				<-r.Done()
				if err := r.Err(); err != nil {
					b.Fatal(err)
				}
			}
			move() // untimed: dial, announce and map the window, fault the pages in
			b.SetBytes(n)
			b.ReportAllocs()
			for b.Loop() {
				move()
			}
		})
	}
}

// benchArena allocates n bytes of shared memory, freed at the end of b
// (after the transports of its sub-benchmarks have closed).
func benchArena(b *testing.B, n int) *memfd.Mapping {
	sa, err := memfd.New(memfdName, n, memfd.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sa.Close() })
	return sa
}

// BenchmarkCeiling measures, next to a plain copy, what the mechanisms that
// keep a peer to its own bytes can reach on this machine at best, without
// any protocol: "two-copy-pipe" copies 512 MiB through a window of 8 slots
// of 1 MiB with a second goroutine copying out of it, handing slots over
// through atomics (the window design with free signalling), the window
// filled as Send fills it (copies of fillChunk); "two-copy-pipe-nt" fills
// each slot with one copy of 1 MiB, which Go writes around the caches, as
// Send did before; "process_vm_readv-1" and "-2"
// read it with the kernel's cross-memory copy (from this process itself),
// on one and two goroutines. The shm backend's own figure (BenchmarkSend)
// is to be read against these.
func BenchmarkCeiling(b *testing.B) {
	const n = 512 << 20
	src, dst := make([]byte, n), make([]byte, n)
	fill(src, 1)
	copy(dst, src) // fault the pages in
	b.Run("copy", func(b *testing.B) {
		b.SetBytes(n)
		for b.Loop() {
			copy(dst, src)
		}
	})
	pipe := func(b *testing.B, chunk int) {
		const slot, slots = 1 << 20, 8
		win := make([]byte, slot*slots)
		b.SetBytes(n)
		for b.Loop() {
			var full [slots]atomic.Bool
			var wg sync.WaitGroup
			wg.Go(func() {
				for k, off := 0, 0; off < n; k, off = k+1, off+slot {
					s := k % slots
					for !full[s].Load() {
						runtime.Gosched()
					}
					copy(dst[off:off+slot], win[s*slot:(s+1)*slot])
					full[s].Store(false)
				}
			})
			for k, off := 0, 0; off < n; k, off = k+1, off+slot {
				s := k % slots
				for full[s].Load() {
					runtime.Gosched()
				}
				for i := 0; i < slot; i += chunk {
					copy(win[s*slot+i:s*slot+i+chunk], src[off+i:off+i+chunk])
				}
				full[s].Store(true)
			}
			wg.Wait()
		}
	}
	b.Run("two-copy-pipe", func(b *testing.B) { pipe(b, fillChunk) })
	b.Run("two-copy-pipe-nt", func(b *testing.B) { pipe(b, 1<<20) })
	vmRead := func(b *testing.B, dst, src []byte) {
		const chunk = 4 << 20
		for off := 0; off < len(dst); off += chunk {
			e := min(off+chunk, len(dst))
			l := []unix.Iovec{{Base: &dst[off], Len: uint64(e - off)}}
			r := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&src[off])), Len: e - off}}
			if _, err := unix.ProcessVMReadv(os.Getpid(), l, r, 0); err != nil {
				b.Skipf("process_vm_readv: %v", err)
			}
		}
	}
	b.Run("process_vm_readv-1", func(b *testing.B) {
		b.SetBytes(n)
		for b.Loop() {
			vmRead(b, dst, src)
		}
	})
	b.Run("process_vm_readv-2", func(b *testing.B) {
		b.SetBytes(n)
		for b.Loop() {
			var wg sync.WaitGroup
			wg.Go(func() { vmRead(b, dst[n/2:], src[n/2:]) })
			vmRead(b, dst[:n/2], src[:n/2])
			wg.Wait()
		}
	})
}

// BenchmarkSendSmall is the transport's share of a small transfer's
// latency: one 64 KiB Send (one part) at a time, Expect to the receipt's
// completion, as the transceiver moves a request of one block.
func BenchmarkSendSmall(b *testing.B) {
	const n = 64 << 10
	tx, rx := open(b, transport.Options{}), open(b, transport.Options{})
	src, dst := fill(make([]byte, n), 3), make([]byte, n)
	ctx := context.Background()
	move := func() {
		r, err := rx.Expect([][]byte{dst})
		if err != nil {
			b.Fatal(err)
		}
		if err := tx.Send(ctx, r.Descriptor(), [][]byte{src}); err != nil {
			b.Fatal(err)
		}
		<-r.Done()
		if err := r.Err(); err != nil {
			b.Fatal(err)
		}
	}
	move() // untimed: dial and map the window
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		move()
	}
}

// BenchmarkSendSmallCrossProcess is BenchmarkSendSmall between two
// processes, as the transceiver uses the transport: Expect here, the
// descriptor handed to the sender (a child process, over its stdin, where
// the transceiver uses its control connection), and the wait for the
// receipt's completion. The stdin hop is part of every op; "echo" is a
// line sent to the child and back over its stdin and stdout, two such
// hops, in the same run for scale.
func BenchmarkSendSmallCrossProcess(b *testing.B) {
	b.Run("echo", func(b *testing.B) {
		c := startChild(b, "echo", 1, false)
		for b.Loop() {
			if _, err := io.WriteString(c.stdin, "ping\n"); err != nil {
				b.Fatal(err)
			}
			if l := <-c.lines; l != "ping" {
				b.Fatalf("child echoed %q", l)
			}
		}
	})
	b.Run("send", benchSendCrossProcess)
}

func benchSendCrossProcess(b *testing.B) {
	const n = 64 << 10
	rx := open(b, transport.Options{})
	dst := make([]byte, n)
	c := startChild(b, "sendloop", n, false)
	move := func() {
		r, err := rx.Expect([][]byte{dst})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := fmt.Fprintf(c.stdin, "DESC %x\n", r.Descriptor()); err != nil {
			b.Fatal(err)
		}
		select {
		case <-r.Done():
		case l := <-c.lines:
			b.Fatalf("child: %s", l)
		}
		if err := r.Err(); err != nil {
			b.Fatal(err)
		}
	}
	move() // untimed: dial and map the window
	if !bytes.Equal(dst, fill(make([]byte, n), 42)) {
		b.Fatal("bytes differ")
	}
	b.SetBytes(n)
	for b.Loop() {
		move()
	}
}
