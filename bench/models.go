package bench

import (
	"fmt"
	"slices"
	"strings"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// Model is the KV shape of a model preset.
type Model struct {
	Name    string
	Layers  int
	KVHeads int
	HeadDim int
	MLA     bool // one latent head of HeadDim, K only
}

// Models are the presets, with the published shapes of the real models.
var Models = []Model{
	{Name: "tiny", Layers: 4, KVHeads: 4, HeadDim: 32},
	{Name: "llama-3.1-8b", Layers: 32, KVHeads: 8, HeadDim: 128},
	{Name: "llama-3.1-70b", Layers: 80, KVHeads: 8, HeadDim: 128},
	{Name: "qwen3-32b", Layers: 64, KVHeads: 8, HeadDim: 128},
	{Name: "deepseek-v3", Layers: 61, KVHeads: 1, HeadDim: 576, MLA: true},
}

// LookupModel finds a preset by name.
func LookupModel(name string) (Model, error) {
	for _, m := range Models {
		if m.Name == strings.ToLower(name) {
			return m, nil
		}
	}
	names := make([]string, len(Models))
	for i, m := range Models {
		names[i] = m.Name
	}
	return Model{}, fmt.Errorf("bench: unknown model %q (presets: %s)", name, strings.Join(names, ", "))
}

// State returns the CacheState of the model on an instance of tp×pp ranks.
// mla forces MLA (DeepSeek-style) on any preset.
func (m Model) State(dt kvcache.DType, tokensPerBlock, tp, pp int, mla bool) (layout.CacheState, error) {
	s := layout.CacheState{
		Shape:    kvcache.Shape{Layers: m.Layers, KVHeads: m.KVHeads, HeadDim: m.HeadDim, TokensPerBlock: tokensPerBlock, KVFactor: 2, DType: dt},
		Parallel: layout.ParallelConfig{TP: tp, PP: pp, CP: 1},
	}
	if m.MLA || mla {
		s.Attention = layout.AttentionMLA
		s.Shape.KVHeads, s.Shape.KVFactor = 1, 1
		if !m.MLA {
			s.Shape.HeadDim = 576
		}
	}
	if err := s.Validate(); err != nil {
		return s, fmt.Errorf("bench: %s on TP%d PP%d: %w", m.Name, tp, pp, err)
	}
	return s, nil
}

func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}
