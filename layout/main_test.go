package layout

import (
	"flag"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"go.uber.org/goleak"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// state builds a CacheState with CP 1 and the other parallel fields zero.
func state(sh kvcache.Shape, tp, pp int) CacheState {
	return CacheState{Shape: sh, Parallel: ParallelConfig{TP: tp, PP: pp, CP: 1}}
}

// mla returns an MLA state of the TensorRT-LLM examples: 16 layers, one
// latent head.
func mla(tp, pp int) CacheState {
	s := state(kvcache.Shape{Layers: 16, KVHeads: 1, HeadDim: 8, TokensPerBlock: 4, KVFactor: 1, DType: kvcache.BF16}, tp, pp)
	s.Attention = AttentionMLA
	return s
}

// llama8B is Llama-3.1-8B's KV shape with 32 tokens per block.
var llama8B = kvcache.Shape{Layers: 32, KVHeads: 8, HeadDim: 128, TokensPerBlock: 32, KVFactor: 2, DType: kvcache.BF16}

func mustTargets(t testing.TB, peer, self CacheState, rank int) []int {
	t.Helper()
	r, err := TargetRanks(peer, self, rank)
	if err != nil {
		t.Fatalf("TargetRanks(rank %d): %v", rank, err)
	}
	return r
}

func mustPlan(t testing.TB, prefill CacheState, c int, gen CacheState, g int) *Plan {
	t.Helper()
	p, err := NewPlan(prefill, c, gen, g)
	if err != nil {
		t.Fatalf("NewPlan(ctx %d, gen %d): %v", c, g, err)
	}
	return p
}
