package engine

import (
	"fmt"
	"testing"
)

// BenchmarkPrefill: one prompt's forward pass on tiny-gqa (TP1, bf16 KV).
func BenchmarkPrefill(b *testing.B) {
	for _, n := range []int{32, 128} {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			in := newTestInstance(b, "tiny-gqa", InstanceConfig{PoolTokens: 1024})
			p := make([]int32, n)
			for i := range p {
				p[i] = int32('a' + i%26)
			}
			s := in.NewSequence()
			defer s.Release()
			if err := s.Reserve(n); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				s.SetLen(0)
				if _, err := in.Prefill(s, p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n)/1e3, "µs/token")
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
			p := make([]int32, tc.seqLen)
			for i := range p {
				p[i] = int32('a' + i%26)
			}
			if _, err := in.Prefill(s, p); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				s.SetLen(tc.seqLen)
				if _, err := in.Decode(s, 'x'); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
