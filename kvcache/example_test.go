package kvcache_test

import (
	"fmt"

	"github.com/kvxfer/kvxfer/kvcache"
)

// The worked example of the package documentation: one block of
// Llama-3.1-8B at TP2 (4 of 8 KV heads per rank), 32 tokens per block, bf16.
func ExampleBlockLayout_Offset() {
	l := kvcache.BlockLayout{Layers: 32, KVFactor: 2, Heads: 4, TokensPerBlock: 32, HeadDim: 128, ElemSize: 2}
	fmt.Println("block bytes:", l.BlockBytes())
	fmt.Println("strides:", l.Offset(0, 0, 0, 1), l.Offset(0, 0, 1, 0), l.Offset(0, 1, 0, 0), l.Offset(1, 0, 0, 0))
	fmt.Println("V, layer 5, head 3, token 17:", l.Offset(5, 1, 3, 17))
	fmt.Println("same row in block 7:", 7*l.BlockBytes()+l.Offset(5, 1, 3, 17))
	// Output:
	// block bytes: 2097152
	// strides: 256 8192 32768 65536
	// V, layer 5, head 3, token 17: 389376
	// same row in block 7: 15069440
}

// A request's life on one rank with prefix reuse: match what is cached,
// allocate the rest, fill and commit the full blocks, release.
func ExamplePool() {
	layout := kvcache.BlockLayout{Layers: 2, KVFactor: 2, Heads: 1, TokensPerBlock: 4, HeadDim: 8, ElemSize: 2}
	pool, err := kvcache.NewPool(layout, 16, kvcache.HeapAllocator{})
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	serve := func(prompt []int32) {
		hashes := kvcache.HashBlocks(kvcache.Hash{}, prompt, layout.TokensPerBlock)
		var table kvcache.BlockTable
		table.Append(pool.MatchPrefix(hashes)...) // pinned, already filled
		reused := table.Len()
		if _, err := table.Grow(pool, len(prompt)); err != nil {
			panic(err)
		}
		// ... prefill writes the KV of blocks reused.. into pool.Block(id) ...
		for i := reused; i < len(hashes); i++ { // full blocks only
			if _, err := pool.Commit(table.IDs()[i], hashes[i]); err != nil {
				panic(err)
			}
		}
		fmt.Printf("%d tokens: %d blocks, %d reused\n", len(prompt), table.Len(), reused)
		if err := table.Release(pool); err != nil {
			panic(err)
		}
	}
	serve([]int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10})
	serve([]int32{1, 2, 3, 4, 5, 6, 7, 8, 42})
	s := pool.Stats()
	fmt.Printf("pinned %d, cached %d, available %d of %d\n", s.Pinned, s.Cached, s.Available(), s.Total)
	// Output:
	// 10 tokens: 3 blocks, 0 reused
	// 9 tokens: 3 blocks, 2 reused
	// pinned 0, cached 2, available 16 of 16
}
