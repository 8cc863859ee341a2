package engine

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// cpuMeter reports, next to a benchmark's wall-clock rate, its rate per
// CPU-second of the whole process (every core's): on a shared machine the
// wall-clock figures move with the load and the CPU ones much less.
type cpuMeter struct{ start time.Duration }

func startCPU() cpuMeter { return cpuMeter{processCPU()} }

// report adds tokens/cpu-s and cpu-ms/op for b.N ops of tokens tokens.
func (m cpuMeter) report(b *testing.B, tokens int) {
	cpu := processCPU() - m.start
	if cpu <= 0 {
		return
	}
	b.ReportMetric(float64(b.N*tokens)/cpu.Seconds(), "tokens/cpu-s")
	b.ReportMetric(float64(cpu.Milliseconds())/float64(b.N), "cpu-ms/op")
}

func benchPrompt(n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32('a' + (i*7)%26)
	}
	return p
}

// BenchmarkPrefill: one prompt's forward pass on tiny-gqa (bf16 KV), TP1
// and, for the long prompt, TP2 in one process. tokens/s counts prompt
// tokens.
func BenchmarkPrefill(b *testing.B) {
	for _, tc := range []struct{ n, tp int }{{32, 1}, {128, 1}, {4000, 1}, {4000, 2}} {
		b.Run(fmt.Sprintf("tokens=%d/tp=%d", tc.n, tc.tp), func(b *testing.B) {
			in := newTestInstance(b, "tiny-gqa", InstanceConfig{TP: tc.tp, PoolTokens: 4096})
			p := benchPrompt(tc.n)
			s := in.NewSequence()
			defer s.Release()
			if err := s.Reserve(tc.n); err != nil {
				b.Fatal(err)
			}
			// One prefill first, so that the scratch has grown.
			if _, err := in.Prefill(s, p); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				s.SetLen(0)
				if _, err := in.Prefill(s, p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*tc.n)/b.Elapsed().Seconds(), "tokens/s")
			cpu.report(b, tc.n)
		})
	}
}

// BenchmarkDecodeStep: one decode step of tiny-gqa after a context of 32 or
// 256 tokens (TP1 and TP2: the same arithmetic, run rank after rank).
func BenchmarkDecodeStep(b *testing.B) {
	for _, tc := range []struct {
		seqLen, tp int
	}{{32, 1}, {256, 1}, {256, 2}} {
		b.Run(fmt.Sprintf("context=%d/tp=%d", tc.seqLen, tc.tp), func(b *testing.B) {
			in := newTestInstance(b, "tiny-gqa", InstanceConfig{TP: tc.tp, PoolTokens: 1024})
			s := in.NewSequence()
			defer s.Release()
			if err := s.Reserve(tc.seqLen + 1); err != nil {
				b.Fatal(err)
			}
			if _, err := in.Prefill(s, benchPrompt(tc.seqLen)); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				s.SetLen(tc.seqLen)
				if _, err := in.Decode(s, 'x'); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
			cpu.report(b, 1)
		})
	}
}

// BenchmarkDecodeBatch: one decode step of a batch of sequences, each
// after a context of 32 to 63 tokens (tiny-gqa, TP1). tokens/s counts the
// tokens generated over the whole batch.
func BenchmarkDecodeBatch(b *testing.B) {
	for _, batch := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			in := newTestInstance(b, "tiny-gqa", InstanceConfig{PoolTokens: 64 * 64})
			seqs := make([]*Sequence, batch)
			toks := make([]int32, batch)
			lens := make([]int, batch)
			for i := range seqs {
				s := in.NewSequence()
				defer s.Release()
				lens[i] = 32 + (i*13)%32
				if err := s.Reserve(lens[i] + 1); err != nil {
					b.Fatal(err)
				}
				if _, err := in.Prefill(s, benchPrompt(lens[i])); err != nil {
					b.Fatal(err)
				}
				seqs[i], toks[i] = s, int32('a'+i%26)
			}
			b.ReportAllocs()
			cpu := startCPU()
			for b.Loop() {
				for i, s := range seqs {
					s.SetLen(lens[i])
				}
				if _, err := in.DecodeBatch(seqs, toks); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "tokens/s")
			cpu.report(b, batch)
		})
	}
}

// BenchmarkEngineDecode: the executor's continuous batching end to end:
// concurrent requests (16-token prompts, 64 tokens generated each) through
// an Engine on tiny-gqa, TP1. tokens/s counts generated tokens over all
// requests.
func BenchmarkEngineDecode(b *testing.B) {
	const gen = 64
	for _, conc := range []int{1, 32} {
		b.Run(fmt.Sprintf("concurrency=%d", conc), func(b *testing.B) {
			e := newTestEngine(b, "tiny-gqa", InstanceConfig{PoolTokens: conc * 128}, Options{MaxBatch: conc})
			streams := make([]*Stream, conc)
			cpu := startCPU()
			for b.Loop() {
				for i := range streams {
					streams[i] = submit(b, e, context.Background(), Request{Prompt: benchPrompt(16), MaxTokens: gen, IgnoreEOS: true})
				}
				for _, s := range streams {
					if res := s.Wait(); res.Final.Err != nil || len(res.Tokens) != gen {
						b.Fatalf("%d tokens, %v", len(res.Tokens), res.Final.Err)
					}
				}
			}
			b.ReportMetric(float64(b.N*conc*gen)/b.Elapsed().Seconds(), "tokens/s")
			cpu.report(b, conc*gen)
		})
	}
}
