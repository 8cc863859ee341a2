package layout

import (
	"slices"
	"testing"
	"time"
)

// Benchmarks on Llama-3.1-8B shapes (32 layers, 8 KV heads, head_dim 128,
// bf16, 32 tokens per block) for a 4096-token request: 128 blocks. Each
// pack or unpack reports x-copy, its speed as a multiple of a copy() of the
// same bytes over the same memory timed alternately with it (benchRatio);
// each family's "copy" sub-benchmark gives the rate of one copy() of those
// bytes between two buffers of its own, for reference.
// With its default staging size (transfer_buffer_size, 512 MiB, as
// TensorRT-LLM's) the transceiver packs a whole 4096-token request into one
// staging buffer: that is "pack"/"unpack". The "staged" variants stream the
// same blocks through a reused staging buffer of stageBlocks blocks, the
// size the transceiver allocates for max_tokens_in_buffer: 1024 (1024/32 + 1
// blocks, as TensorRT-LLM sizes it): 4 chunks, the last one short, through
// a buffer of 33-66 MiB, larger than this machine's caches.

const (
	benchTokens = 4096
	stageBlocks = 1024/32 + 1
)

type benchCase struct {
	name    string
	prefill CacheState
	c       int
	gen     CacheState
	g       int
}

func benchCases() []benchCase {
	return []benchCase{
		{"ctxTP2-genTP1", state(llama8B, 2, 1), 0, state(llama8B, 1, 1), 0},
		{"ctxTP1-genTP2", state(llama8B, 1, 1), 0, state(llama8B, 2, 1), 0},
		{"ctxTP4PP2-genTP8PP1", state(llama8B, 4, 2), 0, state(llama8B, 8, 1), 0},
		{"identical", state(llama8B, 2, 1), 0, state(llama8B, 2, 1), 0},
	}
}

// benchBlocks returns n blocks of size bytes, consecutive in one
// allocation as in a kvcache pool, with every page touched, and that
// allocation.
func benchBlocks(n int, size int64) ([][]byte, []byte) {
	flat := make([]byte, int64(n)*size)
	for j := range flat {
		flat[j] = byte(j)
	}
	out := make([][]byte, n)
	for i := range out {
		out[i] = flat[int64(i)*size : int64(i+1)*size : int64(i+1)*size]
	}
	return out, flat
}

func benchCopy(b *testing.B, n int64) {
	_, src := benchBlocks(1, n)
	_, dst := benchBlocks(1, n)
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		copy(dst, src)
	}
}

// benchRatio times op, which moves n bytes, and reports it (ns/op, MB/s)
// together with the metric "x-copy": op's throughput as a multiple of
// base's, a plain copy() of the same n bytes over the same memory (from
// op's source to op's destination, which base overwrites; op rewrites
// them). The same memory matters: on the machine these figures come from,
// one 512 MiB allocation copies 15-20% slower than another, so a baseline
// on buffers of its own measured their luck, not op. The two alternate
// within one loop (op, base, base, op, op, base, ...: each follows itself
// as often as the other, so neither always finds the caches as the other
// left them); x-copy is the median over iterations of base's time divided
// by op's in the same iteration, so a burst of noise from elsewhere moves
// one pair, not the figure. Only op is timed for ns/op.
func benchRatio(b *testing.B, n int64, op, base func()) {
	var ratios []float64
	b.SetBytes(n)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		baseFirst := i%2 == 1
		i++
		var c time.Duration
		if baseFirst {
			b.StopTimer()
			c = timed(base)
			b.StartTimer()
		}
		start := time.Now()
		op()
		o := time.Since(start)
		b.StopTimer()
		if !baseFirst {
			c = timed(base)
		}
		ratios = append(ratios, c.Seconds()/o.Seconds())
		b.StartTimer()
	}
	slices.Sort(ratios)
	b.ReportMetric(median(ratios), "x-copy")
}

func timed(f func()) time.Duration {
	start := time.Now()
	f()
	return time.Since(start)
}

// median returns the median of sorted v.
func median(v []float64) float64 {
	k := len(v)
	if k%2 == 1 {
		return v[k/2]
	}
	return (v[k/2-1] + v[k/2]) / 2
}

// BenchmarkPack packs a whole request ("pack") and streams it through the
// staging buffer ("pack-staged"). The baseline of pack copies the first n
// bytes of the source blocks' memory into the packed buffer in one copy();
// that of pack-staged copies them through the staging buffer in the same
// chunks.
func BenchmarkPack(b *testing.B) {
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			p := mustPlan(b, bc.prefill, bc.c, bc.gen, bc.g)
			nb := NumBlocks(benchTokens, llama8B.TokensPerBlock)
			per := p.PackedBytesPerBlock()
			n := int64(nb) * per
			b.Run("pack", func(b *testing.B) {
				src, flat := benchBlocks(nb, p.SrcBlockBytes())
				_, dst := benchBlocks(1, n)
				benchRatio(b, n, func() {
					if err := p.Pack(dst, src); err != nil {
						b.Fatal(err)
					}
				}, func() { copy(dst, flat[:n]) })
			})
			b.Run("pack-staged", func(b *testing.B) {
				src, flat := benchBlocks(nb, p.SrcBlockBytes())
				_, stage := benchBlocks(1, stageBlocks*per)
				benchRatio(b, n, func() {
					for i := 0; i < nb; i += stageBlocks {
						k := min(stageBlocks, nb-i)
						if err := p.Pack(stage[:int64(k)*per], src[i:i+k]); err != nil {
							b.Fatal(err)
						}
					}
				}, func() {
					for i := 0; i < nb; i += stageBlocks {
						k := int64(min(stageBlocks, nb-i))
						copy(stage[:k*per], flat[int64(i)*per:int64(i)*per+k*per])
					}
				})
			})
			b.Run("copy", func(b *testing.B) { benchCopy(b, n) })
		})
	}
}

// BenchmarkUnpack is BenchmarkPack's reverse; its baselines copy the packed
// bytes into the first n bytes of the destination blocks' memory.
func BenchmarkUnpack(b *testing.B) {
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			p := mustPlan(b, bc.prefill, bc.c, bc.gen, bc.g)
			nb := NumBlocks(benchTokens, llama8B.TokensPerBlock)
			per := p.PackedBytesPerBlock()
			n := int64(nb) * per
			b.Run("unpack", func(b *testing.B) {
				_, src := benchBlocks(1, n)
				dst, flat := benchBlocks(nb, p.DstBlockBytes())
				benchRatio(b, n, func() {
					if err := p.Unpack(dst, src); err != nil {
						b.Fatal(err)
					}
				}, func() { copy(flat[:n], src) })
			})
			b.Run("unpack-staged", func(b *testing.B) {
				_, stage := benchBlocks(1, stageBlocks*per)
				dst, flat := benchBlocks(nb, p.DstBlockBytes())
				benchRatio(b, n, func() {
					for i := 0; i < nb; i += stageBlocks {
						k := min(stageBlocks, nb-i)
						if err := p.Unpack(dst[i:i+k], stage[:int64(k)*per]); err != nil {
							b.Fatal(err)
						}
					}
				}, func() {
					for i := 0; i < nb; i += stageBlocks {
						k := int64(min(stageBlocks, nb-i))
						copy(flat[int64(i)*per:int64(i)*per+k*per], stage[:k*per])
					}
				})
			})
			b.Run("copy", func(b *testing.B) { benchCopy(b, n) })
		})
	}
}

// BenchmarkNewPlan measures plan construction, which the transceiver does
// once per (request, peer rank) unless it caches plans per layout pair.
func BenchmarkNewPlan(b *testing.B) {
	prefill, gen := state(llama8B, 4, 2), state(llama8B, 8, 1)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := NewPlan(prefill, 0, gen, 0); err != nil {
			b.Fatal(err)
		}
	}
}
