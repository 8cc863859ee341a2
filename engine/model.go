package engine

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/kvxfer/kvxfer/layout"
)

// Config is the architecture of a reference model. Every weight is
// generated from Seed, so a Config is the whole model: two processes that
// build the same Config compute the same tokens.
type Config struct {
	Name      string
	Layers    int
	Hidden    int
	QHeads    int // query heads
	KVHeads   int // KV heads (GQA); ignored for MLA, which caches one latent head
	HeadDim   int // per-head q/k/v width (GQA)
	FFN       int // SwiGLU intermediate width
	MLPChunks int // fixed reduction groups of the MLP; TP must divide it (see doc.go)
	Attention layout.AttentionType

	// MLA (DeepSeek-style) dimensions.
	KVLatent int // compressed KV width (kv_lora_rank)
	RopeDim  int // decoupled RoPE key width, shared by all heads
	NopeDim  int // per-head non-RoPE query/key width
	VHeadDim int // per-head value width

	RopeTheta float64
	NormEps   float64
	Seed      uint64
}

// Presets returns the names of the built-in models.
func Presets() []string { return []string{"tiny-gqa", "tiny-gqa2", "tiny-mla"} }

// Preset returns a built-in model: "tiny-gqa" (4 layers, 8 query heads, 4 KV
// heads of 32, hidden 256, FFN 512), "tiny-gqa2" (the same with 2 KV heads,
// so that TP4 duplicates KV heads) or "tiny-mla" (multi-head latent
// attention: one cached latent of 64 + 32 RoPE dims per token and layer).
func Preset(name string) (Config, error) {
	base := Config{Name: name, Layers: 4, Hidden: 256, QHeads: 8, KVHeads: 4, HeadDim: 32, FFN: 512,
		MLPChunks: 8, Attention: layout.AttentionDefault, RopeTheta: 10000, NormEps: 1e-5}
	switch name {
	case "tiny-gqa":
		base.Seed = 0x6b7678666572_01
	case "tiny-gqa2":
		base.KVHeads, base.Seed = 2, 0x6b7678666572_02
	case "tiny-mla":
		base.Attention, base.KVHeads, base.HeadDim = layout.AttentionMLA, 1, 0
		base.KVLatent, base.RopeDim, base.NopeDim, base.VHeadDim = 64, 32, 32, 32
		base.Seed = 0x6b7678666572_03
	default:
		return Config{}, fmt.Errorf("%w: unknown model preset %q (known: %v)", ErrBadConfig, name, Presets())
	}
	return base, nil
}

// CacheHeads is the number of KV heads the cache holds per layer (1 for MLA).
func (c Config) CacheHeads() int {
	if c.Attention == layout.AttentionMLA {
		return 1
	}
	return c.KVHeads
}

// CacheHeadDim is the width of one cached head: HeadDim, or KVLatent+RopeDim
// for MLA.
func (c Config) CacheHeadDim() int {
	if c.Attention == layout.AttentionMLA {
		return c.KVLatent + c.RopeDim
	}
	return c.HeadDim
}

// KVFactor is 2 (K and V cached) for GQA and 1 (the latent only) for MLA.
func (c Config) KVFactor() int {
	if c.Attention == layout.AttentionMLA {
		return 1
	}
	return 2
}

// vDim is the width of one head's attention output.
func (c Config) vDim() int {
	if c.Attention == layout.AttentionMLA {
		return c.VHeadDim
	}
	return c.HeadDim
}

// Validate reports every problem of c.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: model %q: "+format, append([]any{ErrBadConfig, c.Name}, args...)...))
	}
	pos := func(name string, v, hi int) {
		if v <= 0 || v > hi {
			bad("%s = %d, want 1..%d", name, v, hi)
		}
	}
	pos("layers", c.Layers, 1<<10)
	pos("hidden", c.Hidden, 1<<16)
	pos("q_heads", c.QHeads, 1<<10)
	pos("ffn", c.FFN, 1<<18)
	pos("mlp_chunks", c.MLPChunks, 1<<10)
	if c.MLPChunks > 0 && c.FFN%c.MLPChunks != 0 {
		bad("ffn %d is not a multiple of mlp_chunks %d", c.FFN, c.MLPChunks)
	}
	switch c.Attention {
	case layout.AttentionDefault:
		pos("kv_heads", c.KVHeads, 1<<10)
		pos("head_dim", c.HeadDim, 1<<12)
		if c.KVHeads > 0 && c.QHeads%c.KVHeads != 0 {
			bad("q_heads %d is not a multiple of kv_heads %d", c.QHeads, c.KVHeads)
		}
		if c.HeadDim%2 != 0 {
			bad("head_dim %d must be even (RoPE rotates pairs)", c.HeadDim)
		}
	case layout.AttentionMLA:
		pos("kv_latent", c.KVLatent, 1<<12)
		pos("rope_dim", c.RopeDim, 1<<12)
		pos("nope_dim", c.NopeDim, 1<<12)
		pos("v_head_dim", c.VHeadDim, 1<<12)
		if c.RopeDim%2 != 0 {
			bad("rope_dim %d must be even", c.RopeDim)
		}
	default:
		bad("attention %v", c.Attention)
	}
	if !(c.RopeTheta > 1) {
		bad("rope_theta %v, want > 1", c.RopeTheta)
	}
	if !(c.NormEps > 0) {
		bad("norm_eps %v, want > 0", c.NormEps)
	}
	return errors.Join(errs...)
}

// Model holds the weights of a reference model. Weight matrices are
// float32, row-major with one row per output; every product of a weight
// and a float32 activation is exact in float64 (see doc.go). A Model is
// read-only after NewModel and may be shared by any number of Instances.
type Model struct {
	cfg       Config
	embed     []float32 // [vocab][hidden]
	layers    []layerWeights
	finalNorm []float64 // [hidden]
	lmHead    []float32 // [vocab][hidden]
	lmBias    []float64 // [vocab]
	invFreq   []float64 // RoPE inverse frequencies, [ropeWidth/2]
}

type layerWeights struct {
	attnNorm, mlpNorm []float64 // [hidden]

	// GQA.
	wq     []float32 // [qHeads][headDim][hidden]
	wk, wv []float32 // [kvHeads][headDim][hidden]

	// MLA.
	wqMLA  []float32 // [qHeads][nope+rope][hidden]
	wdkv   []float32 // [latent][hidden]
	kvNorm []float64 // [latent]
	wkr    []float32 // [rope][hidden]
	wukT   []float32 // [qHeads][latent][nope]: absorbed key up-projection
	wuv    []float32 // [qHeads][vHeadDim][latent]

	wo     []float32 // [qHeads][hidden][vDim]: output projection, one block per head
	wg, wu []float32 // [ffn][hidden]
	wd     []float32 // [mlpChunks][hidden][ffn/mlpChunks]: down projection, one block per chunk
}

// NewModel generates the weights of cfg from cfg.Seed.
//
// Weights are uniform with the standard deviation 1/sqrt(fan_in) (norm
// weights are 1). The LM head is a random matrix minus a multiple of the
// embedding: a random transformer whose residual stream is dominated by the
// current token's embedding tends to predict that token again and collapse
// into repeating it; the subtracted embedding makes "the same token again"
// unlikely, so that greedy generations wander instead of sticking. A fixed
// logit bias favours printable ASCII.
func NewModel(cfg Config) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	H, Q, L := cfg.Hidden, cfg.QHeads, cfg.Layers
	g := weightGen{seed: cfg.Seed}
	std := func(fanIn int) float64 { return 1 / math.Sqrt(float64(fanIn)) }
	m := &Model{cfg: cfg}
	m.embed = g.tensor(VocabSize*H, 1)
	for range L {
		lw := layerWeights{attnNorm: ones(H), mlpNorm: ones(H)}
		if cfg.Attention == layout.AttentionMLA {
			lw.wqMLA = g.tensor(Q*(cfg.NopeDim+cfg.RopeDim)*H, std(H))
			lw.wdkv = g.tensor(cfg.KVLatent*H, std(H))
			lw.kvNorm = ones(cfg.KVLatent)
			lw.wkr = g.tensor(cfg.RopeDim*H, std(H))
			lw.wukT = g.tensor(Q*cfg.KVLatent*cfg.NopeDim, std(cfg.NopeDim))
			lw.wuv = g.tensor(Q*cfg.VHeadDim*cfg.KVLatent, std(cfg.KVLatent))
		} else {
			lw.wq = g.tensor(Q*cfg.HeadDim*H, std(H))
			lw.wk = g.tensor(cfg.KVHeads*cfg.HeadDim*H, std(H))
			lw.wv = g.tensor(cfg.KVHeads*cfg.HeadDim*H, std(H))
		}
		lw.wo = g.tensor(Q*H*cfg.vDim(), std(Q*cfg.vDim()))
		lw.wg = g.tensor(cfg.FFN*H, std(H))
		lw.wu = g.tensor(cfg.FFN*H, std(H))
		lw.wd = g.tensor(H*cfg.FFN, std(cfg.FFN))
		m.layers = append(m.layers, lw)
	}
	m.finalNorm = ones(H)
	// lm_head = 4·R/sqrt(H) − 0.5·E: see above. The result is rounded to
	// float32 like every other weight.
	r := g.tensor(VocabSize*H, 4*std(H))
	for i := range r {
		r[i] = float32(float64(r[i]) - 0.5*float64(m.embed[i])*std(H)*4)
	}
	m.lmHead = r
	// A fixed logit bias toward printable ASCII, so that generations look
	// like (nonsense) text rather than random bytes.
	m.lmBias = make([]float64, VocabSize)
	for v := range 128 {
		switch {
		case v >= 'a' && v <= 'z', v == ' ':
			m.lmBias[v] = 6
		case v >= 0x20 && v < 0x7f:
			m.lmBias[v] = 4
		}
	}
	rw := cfg.HeadDim
	if cfg.Attention == layout.AttentionMLA {
		rw = cfg.RopeDim
	}
	m.invFreq = make([]float64, rw/2)
	for i := range m.invFreq {
		m.invFreq[i] = math.Pow(cfg.RopeTheta, -2*float64(i)/float64(rw))
	}
	return m, nil
}

// Config returns the model's configuration.
func (m *Model) Config() Config { return m.cfg }

// weightGen draws tensors from a PCG stream. Each tensor has its own
// stream (seed, index), so a tensor's values do not depend on the shapes of
// the tensors drawn before it.
type weightGen struct {
	seed uint64
	next uint64
}

// tensor returns n float32 values, uniform with standard deviation std.
func (g *weightGen) tensor(n int, std float64) []float32 {
	g.next++
	src := rand.NewPCG(g.seed, 0x9e3779b97f4a7c15*g.next)
	a := std * math.Sqrt(3)
	out := make([]float32, n)
	for i := range out {
		u := float64(src.Uint64()>>11) * 0x1p-53 // [0, 1)
		out[i] = float32((2*u - 1) * a)
	}
	return out
}

func ones(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = 1
	}
	return out
}

// r32 rounds v to float32 precision: the defined rounding points of the
// model's numerics.
func r32(v float64) float64 { return float64(float32(v)) }
