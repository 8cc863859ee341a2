package layout

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kvxfer/kvxfer/kvcache"
)

// AttentionType says how a model caches attention state.
type AttentionType uint8

const (
	// AttentionDefault is multi-head or grouped-query attention: KVHeads
	// heads per layer, sharded over the TP ranks (or duplicated when there
	// are fewer heads than TP ranks).
	AttentionDefault AttentionType = iota
	// AttentionMLA is multi-head latent attention (DeepSeek): one latent
	// "head" per layer (KVHeads must be 1), replicated on every TP rank.
	AttentionMLA
)

// String returns the TensorRT-LLM name: "DEFAULT" or "MLA".
func (a AttentionType) String() string {
	switch a {
	case AttentionDefault:
		return "DEFAULT"
	case AttentionMLA:
		return "MLA"
	}
	return fmt.Sprintf("attention(%d)", uint8(a))
}

// Valid reports whether a is AttentionDefault or AttentionMLA.
func (a AttentionType) Valid() bool { return a <= AttentionMLA }

// ParseAttentionType parses "DEFAULT" or "MLA", case-insensitively.
func ParseAttentionType(s string) (AttentionType, error) {
	switch strings.ToUpper(strings.TrimSpace(s)) {
	case "DEFAULT":
		return AttentionDefault, nil
	case "MLA":
		return AttentionMLA, nil
	}
	return 0, fmt.Errorf("layout: unknown attention type %q (valid: DEFAULT, MLA)", s)
}

// CacheState describes the KV cache of one instance as far as a transfer
// needs to know it: the model-wide shape, how it is sharded, the attention
// type and whether block reuse is on. Both sides of a transfer exchange their
// CacheState before any byte moves (see Compatible).
//
// A CacheState describes one request: with attention DP, Parallel.DPRank is
// the DP group that holds the request.
type CacheState struct {
	Shape      kvcache.Shape
	Parallel   ParallelConfig
	Attention  AttentionType
	BlockReuse bool
}

// ErrInvalidState is wrapped by every error CacheState.Validate returns.
var ErrInvalidState = errors.New("layout: invalid cache state")

// problem is one thing wrong with a CacheState, keyed by the wire/config name
// of the field it is reported against.
type problem struct {
	field  string
	reason string
}

// Validate reports every problem of s at once (joined with errors.Join); each
// wraps ErrInvalidState and names the field.
func (s CacheState) Validate() error {
	ps := s.problems()
	if len(ps) == 0 {
		return nil
	}
	errs := make([]error, len(ps))
	for i, p := range ps {
		errs[i] = fmt.Errorf("%w: %s: %s", ErrInvalidState, p.field, p.reason)
	}
	return errors.Join(errs...)
}

func outOfRange(v, lo, hi int) string {
	return fmt.Sprintf("%d is out of range %d..%d", v, lo, hi)
}

// problems lists everything wrong with s. Relations between fields are
// checked only when the fields involved are themselves in range, so that
// one bad value is reported once.
func (s CacheState) problems() []problem {
	var ps problemList
	sh, p := s.Shape, s.Parallel
	layersOK, headsOK := ps.shape(s)
	tpOK := ps.inRange("tp", p.TP, 1, MaxTP)
	ppOK := ps.inRange("pp", p.PP, 1, MaxPP)
	cpOK := p.CP == 1
	switch {
	case p.CP > 1:
		ps.add("cp", "context parallelism (cp = %d) is not supported: cp must be 1", p.CP)
	case p.CP < 1:
		ps.add("cp", "%d must be 1 (context parallelism is not supported)", p.CP)
	}
	if tpOK && ppOK && cpOK && p.NumRanks() > MaxRanks {
		ps.add("tp", "tp×pp×cp = %d ranks exceeds the limit of %d", p.NumRanks(), MaxRanks)
	}
	dpOK := ps.attentionDP(p, tpOK)
	ps.stages(p, sh.Layers, layersOK, ppOK)
	if headsOK && tpOK && dpOK {
		h, t := sh.KVHeads, p.TPPerDP()
		if h%t != 0 && t%h != 0 {
			ps.add("tp", "%d KV heads cannot be spread over %d TP ranks per DP group (need kv_heads %% tp_per_dp == 0 to shard or tp_per_dp %% kv_heads == 0 to duplicate)", h, t)
		}
	}
	return ps
}

// problemList collects the problems of a CacheState, in the order found.
type problemList []problem

func (ps *problemList) add(field, format string, args ...any) {
	*ps = append(*ps, problem{field, fmt.Sprintf(format, args...)})
}

// inRange reports whether v is in [lo, hi], adding a problem when not.
func (ps *problemList) inRange(field string, v, lo, hi int) bool {
	if v < lo || v > hi {
		ps.add(field, "%s", outOfRange(v, lo, hi))
		return false
	}
	return true
}

// shape checks the shape and the attention of s, and reports whether the
// layers and the KV heads can be used in further checks.
func (ps *problemList) shape(s CacheState) (layersOK, headsOK bool) {
	sh := s.Shape
	layersOK = ps.inRange("layers", sh.Layers, 1, kvcache.MaxLayers)
	headsOK = ps.inRange("kv_heads", sh.KVHeads, 1, kvcache.MaxKVHeads)
	ps.inRange("head_dim", sh.HeadDim, 1, kvcache.MaxHeadDim)
	ps.inRange("tokens_per_block", sh.TokensPerBlock, 1, kvcache.MaxTokensPerBlock)
	if sh.KVFactor != 1 && sh.KVFactor != 2 {
		ps.add("kv_factor", "%d is not 1 (K only) or 2 (K and V)", sh.KVFactor)
	}
	if !sh.DType.Valid() {
		ps.add("dtype", "%v is not a valid dtype", sh.DType)
	}
	if !s.Attention.Valid() {
		ps.add("attention", "%v is not DEFAULT or MLA", s.Attention)
	} else if s.Attention == AttentionMLA && headsOK && sh.KVHeads != 1 {
		ps.add("kv_heads", "MLA caches one latent head per layer: kv_heads must be 1, not %d", sh.KVHeads)
		headsOK = false
	}
	return layersOK, headsOK
}

// attentionDP checks the attention-DP fields (set only with AttentionDP)
// and reports whether the DP size can be used in further checks.
func (ps *problemList) attentionDP(p ParallelConfig, tpOK bool) bool {
	if !p.AttentionDP {
		if p.DPSize != 0 && p.DPSize != 1 {
			ps.add("dp_size", "%d must be 0 or 1 without attention DP", p.DPSize)
		}
		if p.DPRank != 0 {
			ps.add("dp_rank", "%d must be 0 without attention DP", p.DPRank)
		}
		return true
	}
	dpOK := false
	if ps.inRange("dp_size", p.DPSize, 1, MaxTP) && tpOK {
		if p.TP%p.DPSize != 0 {
			ps.add("dp_size", "tp = %d is not a multiple of dp_size = %d", p.TP, p.DPSize)
		} else {
			dpOK = true
		}
		if p.DPRank < 0 || p.DPRank >= p.DPSize {
			ps.add("dp_rank", "%s", outOfRange(p.DPRank, 0, p.DPSize-1))
		}
	}
	return dpOK
}

// stages checks how the layers are split over the PP stages: layers_per_pp
// when given, else at least one layer per stage.
func (ps *problemList) stages(p ParallelConfig, layers int, layersOK, ppOK bool) {
	if len(p.LayersPerPP) == 0 {
		if layersOK && ppOK && p.PP > layers {
			ps.add("pp", "%d stages cannot each hold one of %d layers", p.PP, layers)
		}
		return
	}
	if ppOK && len(p.LayersPerPP) != p.PP {
		ps.add("layers_per_pp", "has %d entries, want pp = %d", len(p.LayersPerPP), p.PP)
	}
	sum, bad := 0, false
	for i, n := range p.LayersPerPP {
		if n < 1 || n > kvcache.MaxLayers {
			ps.add("layers_per_pp", "stage %d: %s", i, outOfRange(n, 1, kvcache.MaxLayers))
			bad = true
		}
		sum += n
	}
	if !bad && layersOK && sum != layers {
		ps.add("layers_per_pp", "%s sums to %d, want layers = %d", formatInts(p.LayersPerPP), sum, layers)
	}
}

// LayerRange returns the global layers [lo, hi) held by PP stage ppRank.
// s must be valid.
func (s CacheState) LayerRange(ppRank int) (lo, hi int) {
	return s.Parallel.LayerRange(s.Shape.Layers, ppRank)
}

// headRange returns the global heads [lo, hi) held by TP rank t of a group of
// T ranks sharing H heads: H/T consecutive heads when T divides H, otherwise
// (T a multiple of H) the one head t/(T/H), duplicated on T/H ranks.
func headRange(h, t, rank int) (lo, hi int) {
	if h%t == 0 {
		n := h / t
		return rank * n, rank*n + n
	}
	lo = rank / (t / h)
	return lo, lo + 1
}

// HeadRange returns the global KV heads [lo, hi) held by rank. When heads are
// duplicated (fewer heads than TP ranks per DP group, or MLA) hi = lo+1 and
// several ranks return the same head. s must be valid and rank in
// [0, NumRanks()).
func (s CacheState) HeadRange(rank int) (lo, hi int) {
	_, _, tp := s.Parallel.Coords(rank)
	_, local := s.Parallel.DPGroup(tp)
	return headRange(s.Shape.KVHeads, s.Parallel.TPPerDP(), local)
}

// RankLayout returns the block layout of rank:
// [layers_in_stage, kv_factor, heads_on_rank, tokens_per_block, head_dim].
// With attention DP every DP group has the same layout, so the result does
// not depend on DPRank. It panics if s is invalid or rank is out of range
// (both are programmer errors: validate states when they arrive).
func (s CacheState) RankLayout(rank int) kvcache.BlockLayout {
	if err := s.Validate(); err != nil {
		panic(fmt.Sprintf("layout: RankLayout of an invalid state: %v", err))
	}
	if rank < 0 || rank >= s.Parallel.NumRanks() {
		panic(fmt.Sprintf("layout: RankLayout: rank %d out of range [0,%d)", rank, s.Parallel.NumRanks()))
	}
	return s.rankLayout(rank)
}

func (s CacheState) rankLayout(rank int) kvcache.BlockLayout {
	pp, _, _ := s.Parallel.Coords(rank)
	lo, hi := s.LayerRange(pp)
	hlo, hhi := s.HeadRange(rank)
	return kvcache.BlockLayout{
		Layers:         hi - lo,
		KVFactor:       s.Shape.KVFactor,
		Heads:          hhi - hlo,
		TokensPerBlock: s.Shape.TokensPerBlock,
		HeadDim:        s.Shape.HeadDim,
		ElemSize:       s.Shape.DType.Size(),
	}
}

// rankPos is where one rank sits in an instance, for one request.
type rankPos struct {
	rank     int
	pp, tp   int
	local    int // TP rank inside the request's DP group
	tpPerDP  int
	lo, hi   int // global layers [lo, hi)
	hlo, hhi int // global heads [hlo, hhi)
}

// locate checks that rank takes part in the request s describes (it exists
// and, with attention DP, belongs to DP group DPRank) and returns its
// position. s must be valid.
func (s CacheState) locate(side string, rank int) (rankPos, error) {
	p := s.Parallel
	if rank < 0 || rank >= p.NumRanks() {
		return rankPos{}, fmt.Errorf("layout: %s rank %d out of range [0,%d)", side, rank, p.NumRanks())
	}
	pp, _, tp := p.Coords(rank)
	group, local := p.DPGroup(tp)
	if p.AttentionDP && group != p.DPRank {
		return rankPos{}, fmt.Errorf("layout: %s rank %d (tp rank %d) is in DP group %d, but the request is held by DP group %d",
			side, rank, tp, group, p.DPRank)
	}
	r := rankPos{rank: rank, pp: pp, tp: tp, local: local, tpPerDP: p.TPPerDP()}
	r.lo, r.hi = s.LayerRange(pp)
	r.hlo, r.hhi = headRange(s.Shape.KVHeads, r.tpPerDP, local)
	return r, nil
}

// clone returns a copy of s that shares no memory with it.
func (s CacheState) clone() CacheState {
	s.Parallel.LayersPerPP = slices.Clone(s.Parallel.LayersPerPP)
	return s
}

// Equal reports whether s and o are the same state (LayersPerPP compared by
// value; nil and empty are equal).
func (s CacheState) Equal(o CacheState) bool {
	a, b := s.Parallel, o.Parallel
	return s.Shape == o.Shape && s.Attention == o.Attention && s.BlockReuse == o.BlockReuse &&
		a.TP == b.TP && a.PP == b.PP && a.CP == b.CP && a.AttentionDP == b.AttentionDP &&
		a.DPRank == b.DPRank && a.DPSize == b.DPSize && slices.Equal(a.LayersPerPP, b.LayersPerPP)
}

// String prints every field on one line, in the order of the wire encoding:
// "layers=32 kv_heads=8 head_dim=128 tokens_per_block=32 kv_factor=2
// dtype=bf16 attention=DEFAULT tp=2 pp=1 cp=1 attention_dp=false dp_rank=0
// dp_size=0 layers_per_pp=[] block_reuse=false".
func (s CacheState) String() string {
	var b strings.Builder
	sh := s.Shape
	fmt.Fprintf(&b, "layers=%d kv_heads=%d head_dim=%d tokens_per_block=%d kv_factor=%d dtype=%v attention=%v ",
		sh.Layers, sh.KVHeads, sh.HeadDim, sh.TokensPerBlock, sh.KVFactor, sh.DType, s.Attention)
	s.Parallel.appendTo(&b)
	fmt.Fprintf(&b, " block_reuse=%t", s.BlockReuse)
	return b.String()
}

// fieldValue returns the printed value of the named field of s, as used in
// Mismatch.
func fieldValue(s CacheState, field string) string {
	sh, p := s.Shape, s.Parallel
	switch field {
	case "layers":
		return fmt.Sprint(sh.Layers)
	case "kv_heads":
		return fmt.Sprint(sh.KVHeads)
	case "head_dim":
		return fmt.Sprint(sh.HeadDim)
	case "tokens_per_block":
		return fmt.Sprint(sh.TokensPerBlock)
	case "kv_factor":
		return fmt.Sprint(sh.KVFactor)
	case "dtype":
		return sh.DType.String()
	case "attention":
		return s.Attention.String()
	case "tp":
		return fmt.Sprint(p.TP)
	case "pp":
		return fmt.Sprint(p.PP)
	case "cp":
		return fmt.Sprint(p.CP)
	case "attention_dp":
		return fmt.Sprint(p.AttentionDP)
	case "dp_rank":
		return fmt.Sprint(p.DPRank)
	case "dp_size":
		return fmt.Sprint(p.DPSize)
	case "layers_per_pp":
		return formatInts(p.LayersPerPP)
	case "block_reuse":
		return fmt.Sprint(s.BlockReuse)
	}
	return "?"
}
