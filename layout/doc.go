// Package layout owns everything about how a KV cache is sharded over the
// ranks of an instance and how it maps between two differently sharded
// instances: the CacheState a rank announces (model shape, parallel config,
// attention type) and its versioned wire encoding, the compatibility check
// that runs before any byte moves, which ranks of the peer instance a rank
// exchanges KV with (TargetRanks), and the per-block copy plans that split a
// context rank's blocks into what each generation rank needs and concatenate
// them on the other side (Plan). It also carries a naive, element-by-element
// reference sharding (reference.go) against which all of that is tested.
//
// layout is pure: no goroutines, no I/O, no clocks. It does not own memory
// (package kvcache does), move bytes between processes (transport) or know
// about requests in flight (transceiver).
//
// # Rank numbering
//
// Inside an instance, as in TensorRT-LLM,
//
//	rank = pp_rank*(TP*CP) + cp_rank*TP + tp_rank
//
// (CP must be 1 here). With TP 2, PP 2 and 10 layers split evenly, rank 0 is
// (pp 0, tp 0), rank 1 is (pp 0, tp 1), rank 2 is (pp 1, tp 0) and rank 3 is
// (pp 1, tp 1); ranks 0 and 1 hold layers [0,5), ranks 2 and 3 hold [5,10).
// Uneven splits are given by ParallelConfig.LayersPerPP; an even split gives
// the remainder to the first stages (10 layers over PP 4: 3, 3, 2, 2).
//
// With attention DP the TP ranks form DPSize groups of TP/DPSize consecutive
// ranks; a request lives in one group (DPRank) and its heads are sharded over
// that group's ranks only.
//
// # Heads and block layout
//
// With H KV heads and T TP ranks per DP group, rank t holds heads
// [t·H/T, (t+1)·H/T) when T divides H, or the single head t/(T/H), duplicated
// on T/H ranks, when H divides T. MLA has one latent head, held by every rank.
// One block of one rank is row-major
//
//	[layers_in_stage][kv_factor][heads_on_rank][tokens_per_block][head_dim]
//
// elements. Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16) with 32
// tokens per block on TP 2: rank 1 holds heads 4..7, a block is
// 32×2×4×32×128×2 bytes = 2 MiB, and element 0 of (layer 3, V, global head 6,
// token 5) is local head 2, row ((3·2+1)·4+2)·32+5 = 965, byte offset
// 965×256 = 247040.
//
// # Which ranks talk to which
//
// A rank's TP share is the interval [t/T, (t+1)/T) of the unit interval; the
// peer TP ranks whose share overlaps it, in the peer stages whose layers
// overlap its layers, are its targets (TargetRanks; for power-of-two ratios
// this is TensorRT-LLM's targetIRanks). The relation is symmetric. When heads
// are duplicated, several context targets of a generation rank hold the same
// head; only the lowest such TP rank sends it, so each generation byte is
// written exactly once, and some targets send nothing.
//
// The transceiver uses this the same way on both sides. A generation rank g
// computes TargetRanks(prefill, gen, g), sends a request-info to each of those
// context ranks (even those whose plan is empty) and, for each, unpacks what
// arrives with NewPlan(prefill, c, gen, g). A context rank c computes
// TargetRanks(gen, prefill, c): that is how many generation ranks will ask; it
// waits until all of them have asked (or the deadline passes), packs for each
// with NewPlan(prefill, c, gen, g) (nothing when PackedBytesPerBlock is 0) and
// releases the request's blocks once every one of them has been served.
//
// # Copy plans and run coalescing
//
// A Plan lists runs {SrcOff, DstOff, Len} within one block, in the
// generation block's order; runs whose sources and destinations are both
// adjacent merge. Take 2 layers, 4 KV heads, kv_factor 2, 2 tokens per block,
// head_dim 4, fp16, so one (layer, kv, head) slab is 2×4×2 = 16 bytes.
// Context TP 2 → generation TP 1: context rank 0 holds heads 0 and 1 (128-byte
// blocks), the generation rank holds heads 0..3 (256-byte blocks). For each
// (layer, kv) the two slabs of heads 0 and 1 are adjacent on both sides and
// merge, giving four runs
//
//	{0 0 32} {32 64 32} {64 128 32} {96 192 32}
//
// and context rank 1 contributes {0 32 32} {32 96 32} {64 160 32} {96 224 32}.
// Context TP 2 → generation TP 2 (identical layouts) gives the single run
// {0 0 128}: Plan.Identity is true and blocks can move without packing.
//
// Pack writes, per block, the contributed bytes contiguously in run order;
// Unpack scatters them back. Since the packed form is contiguous, each side
// merges runs that are adjacent on its own side only (Plan.SrcSpans,
// Plan.DstSpans): above, context rank 0 packs each block with a single
// 128-byte copy, and the generation rank unpacks with four. Both work on any
// sub-range of a request's blocks so that long requests stream through a
// bounded staging buffer.
//
// # How the bytes are copied
//
// Past what the caches hold (memcopy.StreamMin bytes in one call), Pack and
// Unpack copy spans shorter than that with non-temporal stores (AVX
// assembly on amd64 where the processor has AVX, SSE2 where not, copy()
// elsewhere: internal/memcopy), which spare every destination line its
// read for ownership, and prefetch a few KiB ahead, across into the span
// that comes next, while they copy one: each span starts a new stream, and
// the hardware prefetcher, which stops at page boundaries, would otherwise
// let its first lines miss. Longer spans, and smaller calls, use copy(),
// which Go's runtime already streams from StreamMin on. Gathering 8 KiB
// spans of every 16 KiB (context TP4 PP2 → generation TP8) thus went from
// about 0.6× a copy of the same bytes to about 0.8× with SSE2 stores and
// prefetches into L2, and to 0.92-1.15× (median 0.94×, five alternated
// runs) with AVX stores and prefetches 4 KiB ahead into every cache level
// (BenchmarkPack, BenchmarkUnpack).
package layout
