package layout

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

func TestValidate(t *testing.T) {
	ok := state(llama8B, 2, 2)
	tests := []struct {
		name string
		edit func(*CacheState)
		want []string // substrings, one per reported problem, in order
	}{
		{"valid", func(*CacheState) {}, nil},
		{"valid uneven", func(s *CacheState) { s.Parallel.LayersPerPP = []int{30, 2} }, nil},
		{"valid attention dp", func(s *CacheState) {
			s.Parallel = ParallelConfig{TP: 8, PP: 1, CP: 1, AttentionDP: true, DPSize: 8, DPRank: 7}
		}, nil},
		{"valid duplicated heads", func(s *CacheState) { s.Shape.KVHeads = 2; s.Parallel.TP = 8 }, nil},
		{"valid mla", func(s *CacheState) { s.Attention = AttentionMLA; s.Shape.KVHeads = 1; s.Shape.KVFactor = 1 }, nil},
		{"zero state", func(s *CacheState) { *s = CacheState{} }, []string{
			"layers: 0 is out of range 1..4096", "kv_heads: 0 is out of range", "head_dim: 0 is out of range",
			"tokens_per_block: 0 is out of range", "kv_factor: 0 is not 1", "dtype: invalid is not a valid dtype",
			"tp: 0 is out of range", "pp: 0 is out of range", "cp: 0 must be 1",
		}},
		{"cp not supported", func(s *CacheState) { s.Parallel.CP = 2 }, []string{"cp: context parallelism (cp = 2) is not supported"}},
		{"heads do not divide", func(s *CacheState) { s.Shape.KVHeads = 12; s.Parallel.TP = 8 }, []string{
			"tp: 12 KV heads cannot be spread over 8 TP ranks per DP group",
		}},
		{"heads do not divide per dp group", func(s *CacheState) {
			s.Shape.KVHeads = 3
			s.Parallel = ParallelConfig{TP: 6, PP: 1, CP: 1, AttentionDP: true, DPSize: 3}
		}, []string{"tp: 3 KV heads cannot be spread over 2 TP ranks per DP group"}},
		{"mla heads", func(s *CacheState) { s.Attention = AttentionMLA }, []string{"kv_heads: MLA caches one latent head per layer: kv_heads must be 1, not 8"}},
		{"bad attention", func(s *CacheState) { s.Attention = 7 }, []string{"attention: attention(7) is not DEFAULT or MLA"}},
		{"dp size does not divide tp", func(s *CacheState) {
			s.Parallel = ParallelConfig{TP: 4, PP: 1, CP: 1, AttentionDP: true, DPSize: 3, DPRank: 3}
		}, []string{"dp_size: tp = 4 is not a multiple of dp_size = 3", "dp_rank: 3 is out of range 0..2"}},
		{"dp fields without attention dp", func(s *CacheState) { s.Parallel.DPSize = 2; s.Parallel.DPRank = 1 }, []string{
			"dp_size: 2 must be 0 or 1 without attention DP", "dp_rank: 1 must be 0 without attention DP",
		}},
		{"layers per pp length", func(s *CacheState) { s.Parallel.LayersPerPP = []int{32} }, []string{"layers_per_pp: has 1 entries, want pp = 2"}},
		{"layers per pp sum", func(s *CacheState) { s.Parallel.LayersPerPP = []int{16, 15} }, []string{"layers_per_pp: [16,15] sums to 31, want layers = 32"}},
		{"layers per pp empty stage", func(s *CacheState) { s.Parallel.LayersPerPP = []int{32, 0} }, []string{"layers_per_pp: stage 1: 0 is out of range 1..4096"}},
		{"more stages than layers", func(s *CacheState) { s.Shape.Layers = 1 }, []string{"pp: 2 stages cannot each hold one of 1 layers"}},
		{"too many ranks", func(s *CacheState) { s.Shape.KVHeads = 4096; s.Parallel.TP = 4096; s.Parallel.PP = 32 }, []string{"tp: tp×pp×cp = 131072 ranks exceeds the limit of 65536"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ok
			s.Parallel.LayersPerPP = nil
			tt.edit(&s)
			err := s.Validate()
			var got []string
			if err != nil {
				if !errors.Is(err, ErrInvalidState) {
					t.Errorf("error does not wrap ErrInvalidState: %v", err)
				}
				got = strings.Split(err.Error(), "\n")
			}
			if len(got) != len(tt.want) {
				t.Fatalf("Validate reported %d problems, want %d:\n%v", len(got), len(tt.want), err)
			}
			for i, w := range tt.want {
				if !strings.HasPrefix(got[i], "layout: invalid cache state: ") || !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
			}
		})
	}
}

// rl is a block layout [layers, kv, heads, tokens, dim] of elem-byte elements.
func rl(layers, kv, heads, tokens, dim, elem int) kvcache.BlockLayout {
	return kvcache.BlockLayout{Layers: layers, KVFactor: kv, Heads: heads, TokensPerBlock: tokens, HeadDim: dim, ElemSize: elem}
}

func TestHeadsAndRankLayout(t *testing.T) {
	tests := []struct {
		name   string
		s      CacheState
		heads  [][2]int              // HeadRange of every rank
		layout []kvcache.BlockLayout // RankLayout of every rank
	}{
		{"sharded TP2 PP2", state(kvcache.Shape{Layers: 5, KVHeads: 4, HeadDim: 3, TokensPerBlock: 2, KVFactor: 2, DType: kvcache.FP32}, 2, 2),
			[][2]int{{0, 2}, {2, 4}, {0, 2}, {2, 4}},
			[]kvcache.BlockLayout{rl(3, 2, 2, 2, 3, 4), rl(3, 2, 2, 2, 3, 4), rl(2, 2, 2, 2, 3, 4), rl(2, 2, 2, 2, 3, 4)}},
		{"duplicated 2 heads TP4", state(kvcache.Shape{Layers: 1, KVHeads: 2, HeadDim: 3, TokensPerBlock: 2, KVFactor: 2, DType: kvcache.INT8}, 4, 1),
			[][2]int{{0, 1}, {0, 1}, {1, 2}, {1, 2}},
			[]kvcache.BlockLayout{rl(1, 2, 1, 2, 3, 1), rl(1, 2, 1, 2, 3, 1), rl(1, 2, 1, 2, 3, 1), rl(1, 2, 1, 2, 3, 1)}},
		{"12 heads TP3", state(kvcache.Shape{Layers: 1, KVHeads: 12, HeadDim: 1, TokensPerBlock: 1, KVFactor: 1, DType: kvcache.FP16}, 3, 1),
			[][2]int{{0, 4}, {4, 8}, {8, 12}},
			[]kvcache.BlockLayout{rl(1, 1, 4, 1, 1, 2), rl(1, 1, 4, 1, 1, 2), rl(1, 1, 4, 1, 1, 2)}},
		{"mla TP2", mla(2, 1), [][2]int{{0, 1}, {0, 1}}, []kvcache.BlockLayout{rl(16, 1, 1, 4, 8, 2), rl(16, 1, 1, 4, 8, 2)}},
		{"attention dp 2 groups of 2", CacheState{
			Shape:    kvcache.Shape{Layers: 2, KVHeads: 4, HeadDim: 1, TokensPerBlock: 1, KVFactor: 2, DType: kvcache.FP8E4M3},
			Parallel: ParallelConfig{TP: 4, PP: 1, CP: 1, AttentionDP: true, DPSize: 2, DPRank: 1},
		}, [][2]int{{0, 2}, {2, 4}, {0, 2}, {2, 4}}, []kvcache.BlockLayout{rl(2, 2, 2, 1, 1, 1), rl(2, 2, 2, 1, 1, 1), rl(2, 2, 2, 1, 1, 1), rl(2, 2, 2, 1, 1, 1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var heads [][2]int
			var layouts []kvcache.BlockLayout
			for r := range tt.s.Parallel.NumRanks() {
				lo, hi := tt.s.HeadRange(r)
				heads = append(heads, [2]int{lo, hi})
				layouts = append(layouts, tt.s.RankLayout(r))
			}
			if d := cmp.Diff(tt.heads, heads); d != "" {
				t.Errorf("HeadRange (-want +got):\n%s", d)
			}
			if d := cmp.Diff(tt.layout, layouts); d != "" {
				t.Errorf("RankLayout (-want +got):\n%s", d)
			}
		})
	}
}

func TestRankLayoutPanics(t *testing.T) {
	for name, f := range map[string]func(){
		"invalid state": func() { CacheState{}.RankLayout(0) },
		"rank too big":  func() { state(llama8B, 2, 1).RankLayout(2) },
		"negative rank": func() { state(llama8B, 2, 1).RankLayout(-1) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if r := recover(); r == nil || !strings.HasPrefix(r.(string), "layout: RankLayout") {
					t.Errorf("recovered %v, want a layout: RankLayout panic", r)
				}
			}()
			f()
		})
	}
}

func TestAttentionType(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want AttentionType
		err  bool
	}{{"DEFAULT", AttentionDefault, false}, {"mla", AttentionMLA, false}, {" Mla ", AttentionMLA, false}, {"mha", 0, true}} {
		got, err := ParseAttentionType(tt.in)
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("ParseAttentionType(%q) = %v, %v", tt.in, got, err)
		}
		if err == nil && got.String() != strings.ToUpper(strings.TrimSpace(tt.in)) {
			t.Errorf("String() = %q", got.String())
		}
	}
}

func TestStringAndEqual(t *testing.T) {
	s := state(llama8B, 2, 2)
	s.Parallel.LayersPerPP = []int{20, 12}
	want := "layers=32 kv_heads=8 head_dim=128 tokens_per_block=32 kv_factor=2 dtype=bf16 attention=DEFAULT " +
		"tp=2 pp=2 cp=1 attention_dp=false dp_rank=0 dp_size=0 layers_per_pp=[20,12] block_reuse=false"
	if got := s.String(); got != want {
		t.Errorf("String() =\n%s\nwant\n%s", got, want)
	}
	if got, want := s.Parallel.String(), "tp=2 pp=2 cp=1 attention_dp=false dp_rank=0 dp_size=0 layers_per_pp=[20,12]"; got != want {
		t.Errorf("ParallelConfig.String() = %q, want %q", got, want)
	}
	o := s.clone()
	if !s.Equal(o) {
		t.Error("a clone is not Equal")
	}
	o.Parallel.LayersPerPP[0] = 19
	if s.Parallel.LayersPerPP[0] != 20 || s.Equal(o) {
		t.Error("clone shares LayersPerPP or Equal ignores it")
	}
	a, b := state(llama8B, 2, 1), state(llama8B, 2, 1)
	b.Parallel.LayersPerPP = []int{}
	if !a.Equal(b) {
		t.Error("nil and empty LayersPerPP differ")
	}
}
