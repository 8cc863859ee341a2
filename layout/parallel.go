package layout

import (
	"fmt"
	"strconv"
	"strings"
)

// Limits on parallel-config fields. They keep every derived number (rank
// counts, products used for interval arithmetic) far inside an int and let a
// decoder reject absurd values before it allocates anything.
const (
	// MaxTP bounds the tensor-parallel size (and the attention-DP size).
	MaxTP = 1 << 12
	// MaxPP bounds the pipeline-parallel size and therefore the length of
	// ParallelConfig.LayersPerPP.
	MaxPP = 1 << 10
	// MaxCP bounds the context-parallel size a peer may announce. Only 1 is
	// supported; larger values are accepted on the wire so that they can be
	// refused with a readable reason instead of a decode error.
	MaxCP = 1 << 10
	// MaxRanks bounds TP×PP×CP, the number of ranks of one instance.
	MaxRanks = 1 << 16
)

// ParallelConfig says how one instance (all the ranks that serve one model
// replica) is sharded. Ranks are numbered
//
//	rank = pp_rank*(TP*CP) + cp_rank*TP + tp_rank
//
// as in TensorRT-LLM.
type ParallelConfig struct {
	// TP is the tensor-parallel size: the number of ranks a layer's KV heads
	// are spread over (within one DP group when AttentionDP is on).
	TP int
	// PP is the pipeline-parallel size: the number of stages the layers are
	// split over.
	PP int
	// CP is the context-parallel size. Only 1 is supported; a state with a
	// larger CP is refused by Validate and Compatible with a reason that
	// says so.
	CP int
	// AttentionDP enables attention data parallelism: the TP ranks form
	// DPSize groups of TP/DPSize ranks; each group holds all KV heads of
	// the requests scheduled onto it, sharded over its own ranks.
	AttentionDP bool
	// DPRank is the DP group that holds the request this state describes
	// (0 ≤ DPRank < DPSize). Must be 0 when AttentionDP is off.
	DPRank int
	// DPSize is the number of DP groups; TP must be a multiple of it. When
	// AttentionDP is off it must be 0 or 1.
	DPSize int
	// LayersPerPP is the number of attention layers held by each PP stage,
	// in stage order; it must have PP entries, each at least 1, summing to
	// the model's layer count. Empty means an even split: every stage gets
	// layers/PP layers and the first layers%PP stages get one more
	// (10 layers over PP 4 = 3, 3, 2, 2).
	LayersPerPP []int
}

// NumRanks returns TP×PP×CP, the number of ranks in the instance.
func (p ParallelConfig) NumRanks() int { return p.TP * p.PP * p.CP }

// Rank returns the rank of the given coordinates:
// pp*(TP*CP) + cp*TP + tp. It does not check the ranges.
func (p ParallelConfig) Rank(pp, cp, tp int) int { return pp*p.TP*p.CP + cp*p.TP + tp }

// Coords returns the (pp, cp, tp) coordinates of rank, the inverse of Rank.
// It does not check the range; TP and CP must be positive.
func (p ParallelConfig) Coords(rank int) (pp, cp, tp int) {
	tp = rank % p.TP
	cp = rank / p.TP % p.CP
	pp = rank / (p.TP * p.CP)
	return pp, cp, tp
}

// TPPerDP returns the number of TP ranks in one DP group: TP/DPSize with
// attention DP, TP without.
func (p ParallelConfig) TPPerDP() int {
	if p.AttentionDP && p.DPSize > 0 {
		return p.TP / p.DPSize
	}
	return p.TP
}

// DPGroup returns the DP group of a TP rank and its rank inside that group.
// Without attention DP the group is always 0.
func (p ParallelConfig) DPGroup(tpRank int) (group, local int) {
	n := p.TPPerDP()
	return tpRank / n, tpRank % n
}

// StageLayerCounts returns the number of layers of every PP stage for a model
// of numLayers layers: a copy of LayersPerPP, or the even split described on
// LayersPerPP when it is empty.
func (p ParallelConfig) StageLayerCounts(numLayers int) []int {
	if len(p.LayersPerPP) > 0 {
		return append([]int(nil), p.LayersPerPP...)
	}
	out := make([]int, p.PP)
	for i := range out {
		out[i] = p.evenStage(numLayers, i)
	}
	return out
}

func (p ParallelConfig) evenStage(numLayers, stage int) int {
	n := numLayers / p.PP
	if stage < numLayers%p.PP {
		n++
	}
	return n
}

// LayerRange returns the half-open range [lo, hi) of global layer indices
// held by PP stage ppRank of a model with numLayers layers. ppRank must be in
// [0, PP).
func (p ParallelConfig) LayerRange(numLayers, ppRank int) (lo, hi int) {
	if len(p.LayersPerPP) > 0 {
		for i := range ppRank {
			lo += p.LayersPerPP[i]
		}
		return lo, lo + p.LayersPerPP[ppRank]
	}
	base, rem := numLayers/p.PP, numLayers%p.PP
	lo = ppRank*base + min(ppRank, rem)
	return lo, lo + p.evenStage(numLayers, ppRank)
}

// String returns the config in the form used in error messages:
// "tp=2 pp=2 cp=1 attention_dp=false dp_rank=0 dp_size=0 layers_per_pp=[]".
func (p ParallelConfig) String() string {
	var b strings.Builder
	p.appendTo(&b)
	return b.String()
}

func (p ParallelConfig) appendTo(b *strings.Builder) {
	fmt.Fprintf(b, "tp=%d pp=%d cp=%d attention_dp=%t dp_rank=%d dp_size=%d layers_per_pp=%s",
		p.TP, p.PP, p.CP, p.AttentionDP, p.DPRank, p.DPSize, formatInts(p.LayersPerPP))
}

func formatInts(v []int) string {
	var b strings.Builder
	b.WriteByte('[')
	for i, x := range v {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(x))
	}
	b.WriteByte(']')
	return b.String()
}
