// Package kvcache owns the shapes and memory of a rank's KV cache: data
// types, model shapes, the paged block pool with its refcounts and block
// tables, and the prefix-reuse index.
//
// kvcache is pure: it starts no goroutines, performs no I/O beyond the
// memory mappings its allocators create, and reads no clock. It knows nothing
// about parallel layouts (that is package layout), transfers (package
// transceiver) or wire formats (package transport).
//
// # Memory
//
// A Pool is one contiguous Arena from an Allocator (Go heap, anonymous mmap,
// or a memfd another process can map), cut into NumBlocks equal blocks:
// block i starts at byte i×BlockBytes, so a backend registers the arena once
// and addresses any block by offset (Pool.BlockOffset). Each block holds
// TokensPerBlock tokens of one request for the layers and KV heads of this
// rank, laid out row-major as BlockLayout describes:
//
//	[layers_in_stage][kv_factor][heads_on_rank][tokens_per_block][head_dim] elements
//
// so the HeadDim values of one (layer, k-or-v, head, token) are contiguous,
// then the tokens of one head, then the heads of one layer's K (or V).
//
// Worked example: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16)
// at TP2 PP1 with 32 tokens per block. Each rank holds 4 of the 8 heads, so
// its BlockLayout is [32, 2, 4, 32, 128] × 2 bytes = 2,097,152 bytes
// (2 MiB) per block. The strides are
//
//	token   128 × 2 B         =    256 B (RowBytes)
//	head    32 tokens × 256 B =  8 KiB
//	kv      4 heads × 8 KiB   = 32 KiB
//	layer   2 × 32 KiB        = 64 KiB
//
// and the V row of layer 5, head 3 (the rank's fourth head, global head 7 on
// TP rank 1), token 17 of the block starts at
//
//	Offset(5, 1, 3, 17) = 5×64 Ki + 1×32 Ki + 3×8 Ki + 17×256 = 389,376
//
// bytes into the block; in block 7 of the pool, at arena offset
// 7×2 MiB + 389,376 = 15,069,440. A TP1 receiver has 8 heads per block: it
// places this rank's 4 heads of each (layer, kv) as the second 32 KiB half
// of its own 64 KiB (layer, kv) run, which is why a TP split copies in runs
// of heads×tokens_per_block×head_dim elements.
//
// # Ownership and reuse
//
// Blocks are refcounted: Allocate, Lookup and MatchPrefix each give the
// caller one reference per block, Retain adds more, Release gives them
// back. A BlockTable holds one reference to each block of a request, in
// token order. Full blocks whose contents are final can be committed to the
// reuse index under their chained BlockHash; when released they stay cached
// until Allocate needs the space and evicts them, least recently released
// first. FreeBlocks counts cached blocks as available, because Allocate can
// always reclaim them.
//
// A sequence's first block chains from a root parent: the zero Hash, or
// RootHash(salt) for a request that keeps its prefixes apart from other
// tenants' (cache_salt). Blocks committed with CommitTokens also record
// their parent and tokens in a partial-reuse index, so that MatchPartial
// finds the cached block whose first tokens match a prompt's next tokens
// (a caller copies it into a block of its own before writing the rest),
// and TakePartial takes such a block nobody holds out of the index for a
// caller to write in place; the entry leaves with the block when it is
// evicted or taken. PeekPrefix and
// PeekPartial answer the same questions read-only, pinning nothing. With
// TrackEvictions on, the pool records the hashes it evicts until
// DrainEvicted collects them (a KV cache event stream's "removed").
package kvcache
