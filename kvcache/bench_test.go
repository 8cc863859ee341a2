package kvcache

import (
	"testing"
)

// llama8BTP2 is one rank's block of Llama-3.1-8B at TP2: 2 MiB.
var llama8BTP2 = BlockLayout{Layers: 32, KVFactor: 2, Heads: 4, TokensPerBlock: 32, HeadDim: 128, ElemSize: 2}

func newBenchPool(b *testing.B, layout BlockLayout, n int) *Pool {
	b.Helper()
	p, err := NewPool(layout, n, MmapAllocator{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := p.Close(); err != nil {
			b.Error(err)
		}
	})
	return p
}

func BenchmarkAllocateRelease(b *testing.B) {
	for _, n := range []int{1, 16} {
		b.Run(map[int]string{1: "1block", 16: "16blocks"}[n], func(b *testing.B) {
			p := newBenchPool(b, testLayout, 1024)
			ids := make([]BlockID, 0, n)
			b.ReportAllocs()
			for b.Loop() {
				var err error
				ids, err = p.AppendAllocate(ids[:0], n)
				if err != nil {
					b.Fatal(err)
				}
				if err := p.Release(ids...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAllocateEvict allocates from a pool whose every block is cached,
// so each Allocate evicts.
func BenchmarkAllocateEvict(b *testing.B) {
	const n = 1024
	p := newBenchPool(b, testLayout, n)
	// Hash i is committed at step i and evicted at step i+n, before its
	// reuse at step i+2n.
	hashes := make([]Hash, 2*n)
	for i := range hashes {
		hashes[i] = hashN(i)
	}
	ids, _ := p.Allocate(n)
	for i, id := range ids {
		p.Commit(id, hashes[i])
	}
	p.Release(ids...)
	i := n
	b.ReportAllocs()
	for b.Loop() {
		ids, _ = p.AppendAllocate(ids[:0], 1)
		if ok, _ := p.Commit(ids[0], hashes[i%len(hashes)]); !ok {
			b.Fatal("hash still indexed")
		}
		p.Release(ids[0])
		i++
	}
}

func BenchmarkBlock(b *testing.B) {
	p := newBenchPool(b, llama8BTP2, 4)
	ids, _ := p.Allocate(4)
	defer p.Release(ids...)
	var sink int
	b.ReportAllocs()
	for b.Loop() {
		sink += len(p.Block(ids[2]))
	}
	if sink == 0 {
		b.Fatal("no blocks")
	}
}

func BenchmarkMatchPrefix(b *testing.B) {
	p := newBenchPool(b, testLayout, 256)
	tokens := seq(128*4, 1) // 128 blocks
	hashes := HashBlocks(Hash{}, tokens, 4)
	var tb BlockTable
	tb.Grow(p, len(tokens))
	for i, id := range tb.IDs() {
		p.Commit(id, hashes[i])
	}
	tb.Release(p)
	b.ReportAllocs()
	for b.Loop() {
		tb.Append(p.MatchPrefix(hashes)...)
		tb.Release(p)
	}
}

func BenchmarkBlockHash(b *testing.B) {
	tokens := seq(32, 1)
	b.SetBytes(int64(4 * len(tokens)))
	b.ReportAllocs()
	var h Hash
	for b.Loop() {
		h = BlockHash(h, tokens)
	}
}

func BenchmarkHashBlocks(b *testing.B) {
	tokens := seq(4096, 1)
	b.SetBytes(int64(4 * len(tokens)))
	b.ReportAllocs()
	for b.Loop() {
		HashBlocks(Hash{}, tokens, 32)
	}
}

func BenchmarkAllocateReleaseParallel(b *testing.B) {
	p := newBenchPool(b, testLayout, 1024)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		ids := make([]BlockID, 0, 4)
		for pb.Next() {
			ids, _ = p.AppendAllocate(ids[:0], 4)
			p.Release(ids...)
		}
	})
}

var seq32 [32]int32

// TestHotPathsDoNotAllocate pins the allocation-free hot paths. Each case
// gets a pool of 64 blocks in which block 0 is pinned and blocks 1..8 are
// cached under hashN(1..8).
func TestHotPathsDoNotAllocate(t *testing.T) {
	if invariants {
		t.Skip("the invariants build checks the whole pool on every operation")
	}
	ids := make([]BlockID, 0, 64)
	var hashes [9]Hash
	for i := range hashes {
		hashes[i] = hashN(i)
	}
	tests := []struct {
		name string
		f    func(p *Pool)
	}{
		{"Block", func(p *Pool) { _ = p.Block(0) }},
		{"BlockOffset", func(p *Pool) { _ = p.BlockOffset(0) }},
		{"AppendAllocate+Release", func(p *Pool) {
			ids, _ = p.AppendAllocate(ids[:0], 8)
			p.Release(ids...)
		}},
		{"evict and recommit", func(p *Pool) {
			ids, _ = p.AppendAllocate(ids[:0], 63) // 55 free + 8 evicted
			for i, id := range ids[55:] {
				p.Commit(id, hashes[i+1])
			}
			p.Release(ids...)
		}},
		{"Lookup+Release", func(p *Pool) {
			if id, ok := p.Lookup(hashes[7]); ok {
				p.Release(id)
			}
		}},
		{"BlockHash", func(*Pool) { hashes[0] = BlockHash(hashes[0], seq32[:]) }},
		{"Retain+Release", func(p *Pool) {
			p.Retain(0)
			p.Release(0)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPool(t, 64)
			held, _ := p.Allocate(9)
			for i, id := range held[1:] {
				p.Commit(id, hashN(i+1))
			}
			p.Release(held[1:]...)
			if got := testing.AllocsPerRun(20, func() { tt.f(p) }); got != 0 {
				t.Errorf("%v allocations, want 0", got)
			}
			if s := p.Stats(); s.Pinned != 1 || s.Cached != 8 {
				t.Errorf("the case leaked or lost blocks: %+v", s)
			}
		})
	}
}
