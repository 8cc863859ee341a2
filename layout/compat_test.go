package layout

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

func TestCompatibleAccepts(t *testing.T) {
	prefill, gen := state(llama8B, 2, 1), state(llama8B, 1, 4)
	gen.Parallel.LayersPerPP = []int{5, 9, 9, 9}
	gen.BlockReuse = true
	for _, pair := range [][2]CacheState{{prefill, gen}, {gen, prefill}, {mla(4, 2), mla(1, 1)}} {
		if err := Compatible(pair[0], pair[1]); err != nil {
			t.Errorf("Compatible(%v, %v) = %v", pair[0], pair[1], err)
		}
	}
}

// TestCompatibleGolden checks the exact messages users see for incompatible
// pairs. Run with -update to rewrite testdata/incompatible.golden.
func TestCompatibleGolden(t *testing.T) {
	base := state(llama8B, 2, 1)
	with := func(s CacheState, edit func(*CacheState)) CacheState {
		s.Parallel.LayersPerPP = append([]int(nil), s.Parallel.LayersPerPP...)
		edit(&s)
		return s
	}
	tests := []struct {
		name         string
		prefill, gen CacheState
		fields       []string
	}{
		{"dtype", base, with(base, func(s *CacheState) { s.Shape.DType = kvcache.FP8E4M3 }), []string{"dtype"}},
		{"every shape field", base, with(base, func(s *CacheState) {
			s.Shape = kvcache.Shape{Layers: 61, KVHeads: 1, HeadDim: 576, TokensPerBlock: 64, KVFactor: 1, DType: kvcache.FP16}
			s.Attention = AttentionMLA
		}), []string{"layers", "kv_heads", "head_dim", "tokens_per_block", "kv_factor", "dtype", "attention"}},
		{"heads do not divide over gen tp", with(base, func(s *CacheState) { s.Shape.KVHeads = 12 }),
			with(base, func(s *CacheState) { s.Shape.KVHeads = 12; s.Parallel.TP = 8 }), []string{"tp"}},
		{"ctx cp", with(base, func(s *CacheState) { s.Parallel.CP = 2 }), base, []string{"cp"}},
		{"cp on both sides", with(base, func(s *CacheState) { s.Parallel.CP = 4 }), with(base, func(s *CacheState) { s.Parallel.CP = 4 }), []string{"cp"}},
		{"layers per pp", base, with(base, func(s *CacheState) { s.Parallel.PP = 2; s.Parallel.LayersPerPP = []int{16, 8} }), []string{"layers_per_pp"}},
		{"mla with heads", mla(2, 1), with(mla(2, 1), func(s *CacheState) { s.Shape.KVHeads = 8 }),
			[]string{"kv_heads"}},
		{"attention dp", base, with(base, func(s *CacheState) {
			s.Parallel = ParallelConfig{TP: 4, PP: 1, CP: 1, AttentionDP: true, DPSize: 3, DPRank: 5}
		}), []string{"dp_size", "dp_rank"}},
		{"zero gen state", base, CacheState{}, []string{
			"layers", "kv_heads", "head_dim", "tokens_per_block", "kv_factor", "dtype", "tp", "pp", "cp",
		}},
		{"both sides broken", with(base, func(s *CacheState) { s.Shape.HeadDim = 0; s.Parallel.CP = 2 }),
			with(base, func(s *CacheState) { s.Shape.HeadDim = -1; s.Parallel.CP = 2; s.Parallel.LayersPerPP = []int{31} }),
			[]string{"head_dim", "cp", "head_dim", "layers_per_pp"}},
	}
	var b strings.Builder
	for _, tt := range tests {
		err := Compatible(tt.prefill, tt.gen)
		var ie *IncompatibleError
		if !errors.As(err, &ie) {
			t.Errorf("%s: Compatible = %v, want *IncompatibleError", tt.name, err)
			continue
		}
		if !errors.Is(err, ErrIncompatible) {
			t.Errorf("%s: error does not match ErrIncompatible", tt.name)
		}
		var fields []string
		for _, m := range ie.Mismatches {
			fields = append(fields, m.Field)
		}
		if d := cmp.Diff(tt.fields, fields); d != "" {
			t.Errorf("%s: mismatched fields (-want +got):\n%s", tt.name, d)
		}
		if msg := err.Error(); strings.Contains(msg, "\n") || !strings.HasPrefix(msg, "layout: ") {
			t.Errorf("%s: message is not one line prefixed with layout: %q", tt.name, msg)
		}
		if !ie.Ctx.Equal(tt.prefill) || !ie.Gen.Equal(tt.gen) {
			t.Errorf("%s: error does not carry both states", tt.name)
		}
		fmt.Fprintf(&b, "%s\n\t%s\n", tt.name, err)
	}

	path := filepath.Join("testdata", "incompatible.golden")
	if *update {
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if d := cmp.Diff(string(want), b.String()); d != "" {
		t.Errorf("messages differ from %s (-want +got; run with -update if intended):\n%s", path, d)
	}
}

func TestCompatibleErrorDoesNotAlias(t *testing.T) {
	gen := state(llama8B, 1, 2)
	gen.Parallel.LayersPerPP = []int{16, 8}
	err := Compatible(state(llama8B, 2, 1), gen)
	gen.Parallel.LayersPerPP[0] = 24
	var ie *IncompatibleError
	if !errors.As(err, &ie) || ie.Gen.Parallel.LayersPerPP[0] != 16 {
		t.Errorf("IncompatibleError shares LayersPerPP with the caller: %v", err)
	}
}
