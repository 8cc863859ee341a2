package layout

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

// TestTargetRanksUpstream is TensorRT-LLM's own examples (MLA, 16 layers):
// the target ranks of a context rank in the generation instance, in
// upstream's order, and whether the context rank sends anything to each.
func TestTargetRanksUpstream(t *testing.T) {
	tests := []struct {
		name         string
		prefill, gen CacheState
		prefillRank  int
		want         []int
		sends        []bool
	}{
		{"ctx TP4 PP2 to gen TP2 PP2 rank 0", mla(4, 2), mla(2, 2), 0, []int{0}, []bool{true}},
		{"ctx TP4 PP2 to gen TP2 PP2 rank 1", mla(4, 2), mla(2, 2), 1, []int{0}, []bool{false}},
		{"ctx TP4 PP2 to gen TP2 PP2 rank 2", mla(4, 2), mla(2, 2), 2, []int{1}, []bool{true}},
		{"ctx TP2 PP2 to gen TP4 PP2 rank 0", mla(2, 2), mla(4, 2), 0, []int{0, 1}, []bool{true, true}},
		{"ctx TP2 PP2 to gen TP4 PP2 rank 1", mla(2, 2), mla(4, 2), 1, []int{2, 3}, []bool{true, true}},
		{"ctx TP2 PP2 to gen TP4 PP2 rank 2", mla(2, 2), mla(4, 2), 2, []int{4, 5}, []bool{true, true}},
		{"ctx TP2 PP2 to gen TP4 PP2 rank 3", mla(2, 2), mla(4, 2), 3, []int{6, 7}, []bool{true, true}},
		{"ctx TP2 PP1 to gen TP4 PP2 rank 0", mla(2, 1), mla(4, 2), 0, []int{0, 4, 1, 5}, []bool{true, true, true, true}},
		{"ctx TP2 PP1 to gen TP4 PP2 rank 1", mla(2, 1), mla(4, 2), 1, []int{2, 6, 3, 7}, []bool{true, true, true, true}},
		{"ctx TP2 PP1 to gen TP1 PP2 rank 0", mla(2, 1), mla(1, 2), 0, []int{0, 1}, []bool{true, true}},
		{"ctx TP2 PP1 to gen TP1 PP2 rank 1", mla(2, 1), mla(1, 2), 1, []int{0, 1}, []bool{false, false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := mustTargets(t, tt.gen, tt.prefill, tt.prefillRank)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Fatalf("TargetRanks (-want +got):\n%s", d)
			}
			var sends []bool
			for _, g := range got {
				sends = append(sends, mustPlan(t, tt.prefill, tt.prefillRank, tt.gen, g).PackedBytesPerBlock() > 0)
			}
			if d := cmp.Diff(tt.sends, sends); d != "" {
				t.Errorf("sends (-want +got):\n%s", d)
			}
		})
	}

	// Without MLA and with one head per prefill rank, both prefill ranks of the last
	// example send (each holds a different head).
	gqa := func(tp, pp int) CacheState {
		return state(kvcache.Shape{Layers: 16, KVHeads: 2, HeadDim: 8, TokensPerBlock: 4, KVFactor: 2, DType: kvcache.BF16}, tp, pp)
	}
	for c := range 2 {
		for _, g := range mustTargets(t, gqa(1, 2), gqa(2, 1), c) {
			if mustPlan(t, gqa(2, 1), c, gqa(1, 2), g).PackedBytesPerBlock() == 0 {
				t.Errorf("GQA ctx TP2 → gen TP1 PP2: ctx %d sends nothing to gen %d", c, g)
			}
		}
	}
}

// upstreamTP is TensorRT-LLM's TP rule for power-of-two ratios, written out.
func upstreamTP(self, selfN, peerN int) []int {
	if selfN <= peerN {
		r := peerN / selfN
		var out []int
		for i := range r {
			out = append(out, self*r+i)
		}
		return out
	}
	return []int{self / (selfN / peerN)}
}

func TestTargetRanksMatchesUpstreamRule(t *testing.T) {
	sh := kvcache.Shape{Layers: 8, KVHeads: 8, HeadDim: 1, TokensPerBlock: 1, KVFactor: 2, DType: kvcache.FP16}
	for _, st := range []int{1, 2, 4, 8} {
		for _, pt := range []int{1, 2, 4, 8} {
			for s := range st {
				got := mustTargets(t, state(sh, pt, 1), state(sh, st, 1), s)
				if want := upstreamTP(s, st, pt); !slices.Equal(got, want) {
					t.Errorf("self TP%d rank %d → peer TP%d: %v, upstream %v", st, s, pt, got, want)
				}
			}
		}
	}
}

func TestTargetRanksGeneral(t *testing.T) {
	h12 := kvcache.Shape{Layers: 6, KVHeads: 12, HeadDim: 1, TokensPerBlock: 1, KVFactor: 2, DType: kvcache.FP16}
	dp := func(s CacheState, size, rank int) CacheState {
		s.Parallel.AttentionDP, s.Parallel.DPSize, s.Parallel.DPRank = true, size, rank
		return s
	}
	uneven := func(s CacheState, l ...int) CacheState { s.Parallel.LayersPerPP = l; return s }
	tests := []struct {
		name       string
		peer, self CacheState
		rank       int
		want       []int
	}{
		{"TP3 to TP2 rank 0", state(h12, 2, 1), state(h12, 3, 1), 0, []int{0}},
		{"TP3 to TP2 rank 1 straddles", state(h12, 2, 1), state(h12, 3, 1), 1, []int{0, 1}},
		{"TP3 to TP2 rank 2", state(h12, 2, 1), state(h12, 3, 1), 2, []int{1}},
		{"TP2 to TP3 rank 0", state(h12, 3, 1), state(h12, 2, 1), 0, []int{0, 1}},
		{"TP2 to TP3 rank 1", state(h12, 3, 1), state(h12, 2, 1), 1, []int{1, 2}},
		{"TP3 to TP6 rank 1", state(h12, 6, 1), state(h12, 3, 1), 1, []int{2, 3}},
		{"TP4 to TP6 rank 1", state(h12, 6, 1), state(h12, 4, 1), 1, []int{1, 2}},
		{"uneven PP", uneven(state(h12, 1, 3), 1, 4, 1), uneven(state(h12, 1, 2), 2, 4), 1, []int{1, 2}},
		{"uneven PP both", uneven(state(h12, 1, 3), 1, 4, 1), uneven(state(h12, 1, 2), 2, 4), 0, []int{0, 1}},
		{"peer attention dp group 1", dp(state(h12, 4, 1), 2, 1), state(h12, 1, 1), 0, []int{2, 3}},
		{"peer attention dp group 3, PP2", dp(state(h12, 4, 2), 4, 3), state(h12, 2, 1), 1, []int{3, 7}},
		{"self attention dp", state(h12, 2, 1), dp(state(h12, 4, 1), 2, 1), 3, []int{1}},
		{"both attention dp", dp(state(h12, 4, 1), 4, 2), dp(state(h12, 6, 1), 3, 0), 1, []int{2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := mustTargets(t, tt.peer, tt.self, tt.rank)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("TargetRanks (-want +got):\n%s", d)
			}
		})
	}
}

func TestTargetRanksErrors(t *testing.T) {
	s := state(llama8B, 2, 1)
	other := s
	other.Shape.Layers = 16
	dp := state(llama8B, 4, 1)
	dp.Parallel.AttentionDP, dp.Parallel.DPSize, dp.Parallel.DPRank = true, 2, 1
	tests := []struct {
		name       string
		peer, self CacheState
		rank       int
		want       string
		is         error
	}{
		{"rank out of range", s, s, 2, "layout: self rank 2 out of range [0,2)", nil},
		{"negative rank", s, s, -1, "layout: self rank -1 out of range [0,2)", nil},
		{"rank not in dp group", s, dp, 1, "layout: self rank 1 (tp rank 1) is in DP group 0, but the request is held by DP group 1", nil},
		{"invalid self", s, CacheState{}, 0, "layout: self state: layout: invalid cache state: layers", ErrInvalidState},
		{"invalid peer", CacheState{}, s, 0, "layout: peer state: layout: invalid cache state: layers", ErrInvalidState},
		{"layer counts differ", other, s, 0, "layout: incompatible cache states: layers: self=32 peer=16", ErrIncompatible},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := TargetRanks(tt.peer, tt.self, tt.rank)
			if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
				t.Fatalf("err = %v, want prefix %q", err, tt.want)
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("err does not match %v", tt.is)
			}
		})
	}
}
