package engine

import (
	"bytes"
	"fmt"
	"math"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
)

var layouts = []struct {
	name string
	cfg  InstanceConfig
}{
	{"TP2", InstanceConfig{TP: 2}},
	{"TP4", InstanceConfig{TP: 4}},
	{"PP2", InstanceConfig{PP: 2}},
	{"TP2 PP2", InstanceConfig{TP: 2, PP: 2}},
	{"TP4 PP2 uneven", InstanceConfig{TP: 4, PP: 2, LayersPerPP: []int{1, 3}}},
}

// TestLayoutInvariance: the tokens, every step's logits and the KV bytes of
// a generation are the same bit for bit whatever the TP/PP layout.
func TestLayoutInvariance(t *testing.T) {
	type tc struct {
		preset string
		dt     kvcache.DType
	}
	cases := []tc{{"tiny-gqa", kvcache.BF16}, {"tiny-gqa2", kvcache.BF16}, {"tiny-mla", kvcache.BF16},
		{"tiny-gqa", kvcache.FP8E4M3}, {"tiny-gqa2", kvcache.FP16}, {"tiny-mla", kvcache.FP32}}
	p := prompt("Layout: 1, 2, 3!") // 17 tokens: a partial third block
	const n = 12
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s %v", c.preset, c.dt), func(t *testing.T) {
			base := InstanceConfig{TokensPerBlock: 8, DType: c.dt, PoolTokens: 256}
			ref := generate(t, newTestInstance(t, c.preset, base), p, n, 0, 0)
			for _, l := range layouts {
				cfg := l.cfg
				cfg.TokensPerBlock, cfg.DType, cfg.PoolTokens = base.TokensPerBlock, base.DType, base.PoolTokens
				got := generate(t, newTestInstance(t, c.preset, cfg), p, n, 0, 0)
				compareRuns(t, l.name, ref, got)
			}
		})
	}
}

// TestLayoutInvarianceSampled: seeded sampling draws the same tokens on
// every layout too.
func TestLayoutInvarianceSampled(t *testing.T) {
	p := prompt("Sampled")
	base := InstanceConfig{TokensPerBlock: 16, PoolTokens: 128}
	ref := generate(t, newTestInstance(t, "tiny-gqa", base), p, 10, 0.9, 42)
	cfg := InstanceConfig{TP: 2, PP: 2, TokensPerBlock: 16, PoolTokens: 128}
	got := generate(t, newTestInstance(t, "tiny-gqa", cfg), p, 10, 0.9, 42)
	compareRuns(t, "TP2 PP2 sampled", ref, got)
	other := generate(t, newTestInstance(t, "tiny-gqa", base), p, 10, 0.9, 43)
	if fmt.Sprint(other.tokens) == fmt.Sprint(ref.tokens) {
		t.Errorf("seeds 42 and 43 drew the same %d tokens", len(ref.tokens))
	}
}

func compareRuns(t *testing.T, name string, ref, got run) {
	t.Helper()
	if fmt.Sprint(got.tokens) != fmt.Sprint(ref.tokens) {
		t.Errorf("%s: tokens %v, TP1 PP1 %v", name, got.tokens, ref.tokens)
	}
	for i := range min(len(got.logits), len(ref.logits)) {
		for v := range ref.logits[i] {
			if math.Float32bits(got.logits[i][v]) != math.Float32bits(ref.logits[i][v]) {
				t.Errorf("%s: step %d logit %d is %v, TP1 PP1 %v", name, i, v, got.logits[i][v], ref.logits[i][v])
				break
			}
		}
	}
	if !bytes.Equal(got.kv, ref.kv) {
		t.Errorf("%s: KV bytes differ from TP1 PP1 (%d bytes, first difference at %d)", name, len(ref.kv), firstDiff(got.kv, ref.kv))
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
