//go:build linux

package shm

import (
	"context"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transport"
)

// BenchmarkSend moves one 512 MiB buffer per iteration between two
// Transports (Send, then wait for the receipt): "shm" with the default
// 1 MiB window slots, "shm-256KiB-slots" with smaller ones. "copy" is the
// baseline in the same run: a plain copy between the same two buffers.
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
	for _, sub := range []struct {
		name        string
		slot, slots int
	}{{"shm", 0, 0}, {"shm-256K-x8", 256 << 10, 8}, {"shm-1M-x4", 1 << 20, 4}, {"shm-2M-x4", 2 << 20, 4}, {"shm-4M-x4", 4 << 20, 4}, {"shm-4M-x2", 4 << 20, 2}, {"shm-8M-x2", 8 << 20, 2}} {
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
func benchArena(b *testing.B, n int) *kvcache.ShmArena {
	a, err := kvcache.ShmAllocator{Name: memfdName}.Allocate(n)
	if err != nil {
		b.Fatal(err)
	}
	sa := a.(*kvcache.ShmArena)
	b.Cleanup(func() { sa.Close() })
	return sa
}
