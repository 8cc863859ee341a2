package layout_test

import (
	"fmt"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

var llama = kvcache.Shape{Layers: 32, KVHeads: 8, HeadDim: 128, TokensPerBlock: 32, KVFactor: 2, DType: kvcache.BF16}

// The block layout example of the package doc.
func ExampleCacheState_RankLayout() {
	s := layout.CacheState{Shape: llama, Parallel: layout.ParallelConfig{TP: 2, PP: 1, CP: 1}}
	lo, hi := s.HeadRange(1)
	bl := s.RankLayout(1)
	fmt.Println("heads", lo, hi, "block bytes", bl.BlockBytes())
	fmt.Println("offset", bl.Offset(3, 1, 6-lo, 5))
	// Output:
	// heads 4 8 block bytes 2097152
	// offset 247040
}

// How a transceiver uses TargetRanks and NewPlan on both sides, for context
// TP 2 → generation TP 1 PP 2.
func ExampleTargetRanks() {
	prefill := layout.CacheState{Shape: llama, Parallel: layout.ParallelConfig{TP: 2, PP: 1, CP: 1}}
	gen := layout.CacheState{Shape: llama, Parallel: layout.ParallelConfig{TP: 1, PP: 2, CP: 1}}

	// Generation side: whom each rank asks, and what it receives per block.
	for g := range gen.Parallel.NumRanks() {
		prefillRanks, _ := layout.TargetRanks(prefill, gen, g)
		for _, c := range prefillRanks {
			p, _ := layout.NewPlan(prefill, c, gen, g)
			fmt.Printf("gen %d asks ctx %d: %d bytes per block in %d spans\n", g, c, p.PackedBytesPerBlock(), len(p.DstSpans()))
		}
	}
	// Context side: how many generation ranks will ask before the request's
	// blocks can be released.
	for c := range prefill.Parallel.NumRanks() {
		genRanks, _ := layout.TargetRanks(gen, prefill, c)
		fmt.Printf("ctx %d waits for gen %v\n", c, genRanks)
	}
	// Output:
	// gen 0 asks ctx 0: 1048576 bytes per block in 32 spans
	// gen 0 asks ctx 1: 1048576 bytes per block in 32 spans
	// gen 1 asks ctx 0: 1048576 bytes per block in 32 spans
	// gen 1 asks ctx 1: 1048576 bytes per block in 32 spans
	// ctx 0 waits for gen [0 1]
	// ctx 1 waits for gen [0 1]
}

// Pack on the context rank, Unpack on the generation rank, streamed through
// a staging buffer of two blocks.
func ExamplePlan_Pack() {
	sh := kvcache.Shape{Layers: 2, KVHeads: 4, HeadDim: 4, TokensPerBlock: 2, KVFactor: 2, DType: kvcache.FP16}
	prefill := layout.CacheState{Shape: sh, Parallel: layout.ParallelConfig{TP: 2, PP: 1, CP: 1}}
	gen := layout.CacheState{Shape: sh, Parallel: layout.ParallelConfig{TP: 1, PP: 1, CP: 1}}
	logical, _ := layout.NewLogical(sh, 9) // 5 blocks
	logical.Fill(1)

	genBlocks := make([][]byte, 5)
	for i := range genBlocks {
		genBlocks[i] = make([]byte, gen.RankLayout(0).BlockBytes())
	}
	for c := range 2 {
		prefillBlocks, _ := layout.Shard(logical, prefill, c)
		p, _ := layout.NewPlan(prefill, c, gen, 0)
		fmt.Println("ctx", c, "runs", p.Runs())
		stage := make([]byte, 2*p.PackedBytesPerBlock())
		for i := 0; i < len(prefillBlocks); i += 2 {
			j := min(i+2, len(prefillBlocks))
			buf := stage[:int64(j-i)*p.PackedBytesPerBlock()]
			_ = p.Pack(buf, prefillBlocks[i:j]) // context rank
			_ = p.Unpack(genBlocks[i:j], buf)   // generation rank, after the transport
		}
	}
	want, _ := layout.Shard(logical, gen, 0)
	same := true
	for i := range want {
		same = same && string(want[i]) == string(genBlocks[i])
	}
	fmt.Println("generation blocks equal the reference:", same)
	// Output:
	// ctx 0 runs [{0 0 32} {32 64 32} {64 128 32} {96 192 32}]
	// ctx 1 runs [{0 32 32} {32 96 32} {64 160 32} {96 224 32}]
	// generation blocks equal the reference: true
}
