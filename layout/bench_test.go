package layout

import (
	"testing"
	"time"
)

// Benchmarks on Llama-3.1-8B shapes (32 layers, 8 KV heads, head_dim 128,
// bf16, 32 tokens per block) for a 4096-token request: 128 blocks. Each
// family has a "copy" sub-benchmark that moves the same number of bytes with
// one copy() between two flat buffers, so the ratio can be read off one run.
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

// benchBlocks returns n blocks of size bytes with every page touched.
func benchBlocks(n int, size int64) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, size)
		for j := range out[i] {
			out[i][j] = byte(i + j)
		}
	}
	return out
}

func benchCopy(b *testing.B, n int64) {
	src, dst := benchBlocks(1, n)[0], benchBlocks(1, n)[0]
	b.SetBytes(n)
	b.ReportAllocs()
	for b.Loop() {
		copy(dst, src)
	}
}

// reportRatio reports the throughput of the loop just run as a multiple of a
// plain copy() of the same n bytes, timed right after it (best of 3), as
// the metric "x-copy".
func reportRatio(b *testing.B, n int64) {
	if b.N == 0 || b.Elapsed() <= 0 {
		return
	}
	perOp := b.Elapsed().Seconds() / float64(b.N)
	src, dst := benchBlocks(1, n)[0], benchBlocks(1, n)[0]
	best := time.Duration(1<<62 - 1)
	for range 3 {
		start := time.Now()
		copy(dst, src)
		best = min(best, time.Since(start))
	}
	b.ReportMetric(best.Seconds()/perOp, "x-copy")
}

func BenchmarkPack(b *testing.B) {
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			p := mustPlan(b, bc.prefill, bc.c, bc.gen, bc.g)
			nb := NumBlocks(benchTokens, llama8B.TokensPerBlock)
			n := int64(nb) * p.PackedBytesPerBlock()
			b.Run("pack", func(b *testing.B) {
				src := benchBlocks(nb, p.SrcBlockBytes())
				dst := benchBlocks(1, n)[0]
				b.SetBytes(n)
				b.ReportAllocs()
				for b.Loop() {
					if err := p.Pack(dst, src); err != nil {
						b.Fatal(err)
					}
				}
				reportRatio(b, n)
			})
			b.Run("pack-staged", func(b *testing.B) {
				src := benchBlocks(nb, p.SrcBlockBytes())
				stage := benchBlocks(1, stageBlocks*p.PackedBytesPerBlock())[0]
				b.SetBytes(n)
				b.ReportAllocs()
				for b.Loop() {
					for i := 0; i < nb; i += stageBlocks {
						k := min(stageBlocks, nb-i)
						if err := p.Pack(stage[:int64(k)*p.PackedBytesPerBlock()], src[i:i+k]); err != nil {
							b.Fatal(err)
						}
					}
				}
				reportRatio(b, n)
			})
			b.Run("copy", func(b *testing.B) { benchCopy(b, n) })
		})
	}
}

func BenchmarkUnpack(b *testing.B) {
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			p := mustPlan(b, bc.prefill, bc.c, bc.gen, bc.g)
			nb := NumBlocks(benchTokens, llama8B.TokensPerBlock)
			n := int64(nb) * p.PackedBytesPerBlock()
			b.Run("unpack", func(b *testing.B) {
				src := benchBlocks(1, n)[0]
				dst := benchBlocks(nb, p.DstBlockBytes())
				b.SetBytes(n)
				b.ReportAllocs()
				for b.Loop() {
					if err := p.Unpack(dst, src); err != nil {
						b.Fatal(err)
					}
				}
				reportRatio(b, n)
			})
			b.Run("unpack-staged", func(b *testing.B) {
				stage := benchBlocks(1, stageBlocks*p.PackedBytesPerBlock())[0]
				dst := benchBlocks(nb, p.DstBlockBytes())
				b.SetBytes(n)
				b.ReportAllocs()
				for b.Loop() {
					for i := 0; i < nb; i += stageBlocks {
						k := min(stageBlocks, nb-i)
						if err := p.Unpack(dst[i:i+k], stage[:int64(k)*p.PackedBytesPerBlock()]); err != nil {
							b.Fatal(err)
						}
					}
				}
				reportRatio(b, n)
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
