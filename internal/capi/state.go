package capi

import (
	"fmt"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// StateDesc describes an instance's cache state as the C ABI's
// kvxfer_cache_state does: the model shape and the parallel layout.
type StateDesc struct {
	Layers, KVHeads, HeadDim, TokensPerBlock int
	// KVFactor is 2 (K and V) or 1 (K only, MLA); 0 means 1 for MLA and 2
	// otherwise.
	KVFactor  int
	DType     kvcache.DType
	Attention layout.AttentionType
	TP, PP    int
	// AttentionDP enables attention data parallelism over DPSize groups.
	AttentionDP bool
	DPSize      int
	// LayersPerPP is the number of layers of each PP stage; empty means
	// an even split.
	LayersPerPP []int
}

// CacheState returns the layout.CacheState d describes, validated (every
// problem at once).
func (d StateDesc) CacheState() (layout.CacheState, error) {
	kvf := d.KVFactor
	if kvf == 0 {
		kvf = 2
		if d.Attention == layout.AttentionMLA {
			kvf = 1
		}
	}
	dp := d.DPSize
	if !d.AttentionDP && dp == 0 {
		dp = 1
	}
	s := layout.CacheState{
		Shape: kvcache.Shape{Layers: d.Layers, KVHeads: d.KVHeads, HeadDim: d.HeadDim, TokensPerBlock: d.TokensPerBlock,
			KVFactor: kvf, DType: d.DType},
		Parallel: layout.ParallelConfig{TP: d.TP, PP: d.PP, CP: 1, AttentionDP: d.AttentionDP, DPSize: dp,
			LayersPerPP: append([]int(nil), d.LayersPerPP...)},
		Attention: d.Attention,
	}
	if err := s.Validate(); err != nil {
		return s, &Error{Code: CodeInvalidArgument, Err: fmt.Errorf("capi: cache state: %w", err)}
	}
	return s, nil
}
