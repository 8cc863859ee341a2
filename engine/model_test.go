package engine

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// TestGenerationsNotDegenerate: greedy generations of every preset use many
// different tokens and never repeat one token on and on; logits are finite
// and spread.
func TestGenerationsNotDegenerate(t *testing.T) {
	for _, name := range Presets() {
		t.Run(name, func(t *testing.T) {
			in := newTestInstance(t, name, InstanceConfig{TokensPerBlock: 16, PoolTokens: 256})
			for _, p := range []string{"Hello, world!", "The quick brown fox"} {
				r := generate(t, in, prompt(p), 48, 0, 0)
				distinct := map[int32]bool{}
				run, longest := 0, 0
				for i, tok := range r.tokens {
					distinct[tok] = true
					if i > 0 && tok == r.tokens[i-1] {
						run++
					} else {
						run = 1
					}
					longest = max(longest, run)
				}
				if len(distinct) < 10 || longest > 3 {
					t.Errorf("%q → %q: %d distinct tokens, longest run %d", p, Tokenizer{}.Decode(r.tokens), len(distinct), longest)
				}
				for _, lg := range r.logits {
					lo, hi := math.Inf(1), math.Inf(-1)
					for _, l := range lg {
						if math.IsNaN(float64(l)) || math.IsInf(float64(l), 0) {
							t.Fatalf("logit %v", l)
						}
						lo, hi = min(lo, float64(l)), max(hi, float64(l))
					}
					if hi-lo < 1 || hi-lo > 200 {
						t.Errorf("logits span %g..%g", lo, hi)
					}
				}
			}
		})
	}
}

// TestModelDeterministic: two models built from one config are the same
// model.
func TestModelDeterministic(t *testing.T) {
	cfg, _ := Preset("tiny-mla")
	a, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b := testModel(t, "tiny-mla")
	if !slices.Equal(a.lmHead, b.lmHead) || !slices.Equal(a.layers[3].wuv, b.layers[3].wuv) || !slices.Equal(a.embed, b.embed) {
		t.Error("weights differ between two builds of one config")
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := Preset("gpt-5"); !errors.Is(err, ErrBadConfig) {
		t.Errorf("unknown preset: %v", err)
	}
	bad, _ := Preset("tiny-gqa")
	bad.QHeads, bad.FFN, bad.NormEps = 6, 500, 0
	err := bad.Validate()
	for _, want := range []string{"q_heads 6 is not a multiple of kv_heads 4", "ffn 500", "norm_eps"} {
		if err == nil || !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate: %v, want %q", err, want)
		}
	}
	m := testModel(t, "tiny-gqa")
	tests := []struct {
		name string
		cfg  InstanceConfig
		want string
	}{
		{"TP3", InstanceConfig{TP: 3}, "tp 3 does not divide the 8 query heads"},
		{"TP16", InstanceConfig{TP: 16}, "does not divide"},
		{"int8", InstanceConfig{DType: kvcache.INT8}, "int8 is not supported"},
		{"PP5", InstanceConfig{PP: 5}, "5 stages cannot each hold one of 4 layers"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in, err := NewInstance(m, tc.cfg)
			if err == nil {
				in.Close()
			}
			if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NewInstance: %v, want %q", err, tc.want)
			}
		})
	}
}

// TestInstanceState: the CacheState and the pools' layouts are what the
// transceiver expects.
func TestInstanceState(t *testing.T) {
	in := newTestInstance(t, "tiny-mla", InstanceConfig{TP: 2, PP: 2, TokensPerBlock: 16, DType: kvcache.FP8E4M3, PoolTokens: 100})
	st := in.State()
	want := kvcache.Shape{Layers: 4, KVHeads: 1, HeadDim: 96, TokensPerBlock: 16, KVFactor: 1, DType: kvcache.FP8E4M3}
	if st.Shape != want || st.Attention != layout.AttentionMLA || st.Parallel.NumRanks() != 4 {
		t.Fatalf("state %v", st)
	}
	for r, p := range in.Pools() {
		if p.Layout() != st.RankLayout(r) || p.NumBlocks() != 7 {
			t.Errorf("rank %d: pool %+v × %d", r, p.Layout(), p.NumBlocks())
		}
	}
	g := newTestInstance(t, "tiny-gqa2", InstanceConfig{TP: 4, TokensPerBlock: 16, PoolTokens: 16})
	for r, p := range g.Pools() {
		if l := p.Layout(); l.Heads != 1 || l.KVFactor != 2 || l.HeadDim != 32 || l.Layers != 4 {
			t.Errorf("tiny-gqa2 TP4 rank %d: %+v (duplicated heads: one each)", r, l)
		}
	}
}

// TestPrefillZeroesTail: the unused slots of a prompt's last block are
// zero after prefill even when the block held another request's KV, so
// stale KV never travels in a transfer.
func TestPrefillZeroesTail(t *testing.T) {
	in := newTestInstance(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 64, DType: kvcache.FP16})
	dirty := in.NewSequence()
	if err := dirty.Reserve(64); err != nil {
		t.Fatal(err)
	}
	for _, r := range in.ranks {
		for _, b := range dirty.blocks[r.idx] {
			mem := r.pool.Block(b)
			for i := range mem {
				mem[i] = 0xab
			}
		}
	}
	if err := dirty.Release(); err != nil {
		t.Fatal(err)
	}
	s := in.NewSequence()
	defer s.Release()
	if err := s.Reserve(20); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Prefill(s, prompt("twelve bytes")); err != nil { // 13 tokens: 5 of block 1 used
		t.Fatal(err)
	}
	for _, r := range in.ranks {
		mem := r.pool.Block(s.blocks[r.idx][1])
		for l := range r.bl.Layers {
			for kv := range r.bl.KVFactor {
				for h := range r.bl.Heads {
					used := mem[r.bl.Offset(l, kv, h, 0):r.bl.Offset(l, kv, h, 5)]
					tail := mem[r.bl.Offset(l, kv, h, 5):r.bl.Offset(l, kv, h, 8)]
					for _, c := range tail {
						if c != 0 {
							t.Fatalf("rank %d layer %d kv %d head %d: tail byte %#x", r.idx, l, kv, h, c)
						}
					}
					if string(used[:2]) == "\xab\xab" {
						t.Fatalf("rank %d: used slot not written", r.idx)
					}
				}
			}
		}
	}
}

func TestSampling(t *testing.T) {
	logits := make([]float32, VocabSize)
	for i := range logits {
		logits[i] = float32(i%7) / 2
	}
	logits[BOS] = 100 // never chosen
	if got := sampleToken(logits, 0, 0, 0); got != 6 {
		t.Errorf("greedy = %d, want 6 (the lowest id of the maximum, BOS excluded)", got)
	}
	seen := map[int32]bool{}
	for i := range 200 {
		a, b := sampleToken(logits, 1, 9, i), sampleToken(logits, 1, 9, i)
		if a != b || a == BOS || a < 0 {
			t.Fatalf("draw %d: %d then %d", i, a, b)
		}
		seen[a] = true
	}
	if len(seen) < 20 {
		t.Errorf("temperature 1 drew only %d distinct tokens in 200", len(seen))
	}
}
