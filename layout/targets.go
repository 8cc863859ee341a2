package layout

import "fmt"

// tpOverlap returns the peer TP ranks [lo, hi), out of peerN per DP group,
// whose share of the heads overlaps that of TP rank self out of selfN.
//
// Rank t of n owns the interval [t/n, (t+1)/n) of the unit interval; two
// intervals overlap when each starts before the other ends. Scaling by
// selfN×peerN (a multiple of their lcm) keeps this in integers:
// p overlaps self iff p*selfN < (self+1)*peerN and self*peerN < (p+1)*selfN,
// that is floor(self*peerN/selfN) ≤ p < ceil((self+1)*peerN/selfN).
//
// For power-of-two ratios this is TensorRT-LLM's rule: when selfN ≤ peerN,
// the peerN/selfN ranks starting at self*(peerN/selfN); otherwise the one
// rank self/(selfN/peerN).
func tpOverlap(self, selfN, peerN int) (lo, hi int) {
	lo = self * peerN / selfN
	hi = ((self+1)*peerN + selfN - 1) / selfN
	return lo, hi
}

// checkPair validates both states of a rank pairing and that they describe
// the same model depth, which is all that target computation needs.
func checkPair(peer, self CacheState) error {
	if err := self.Validate(); err != nil {
		return fmt.Errorf("layout: self state: %w", err)
	}
	if err := peer.Validate(); err != nil {
		return fmt.Errorf("layout: peer state: %w", err)
	}
	if peer.Shape.Layers != self.Shape.Layers {
		return fmt.Errorf("%w: layers: self=%d peer=%d", ErrIncompatible, self.Shape.Layers, peer.Shape.Layers)
	}
	return nil
}

// TargetRanks returns the ranks of the peer instance that rank selfRank of
// the self instance exchanges KV with for one request: every peer rank whose
// layers overlap selfRank's layers (PP) and whose share of the KV heads
// overlaps selfRank's share (TP, within the request's DP group on each side).
// It is symmetric: g is in TargetRanks(gen, prefill, c) exactly when c is in
// TargetRanks(prefill, gen, g).
//
// The order is TensorRT-LLM's targetIRanks order (CP = 1): peer TP ranks in
// the outer loop, peer PP stages in the inner loop. Ratios between the TP
// sizes need not be powers of two.
//
// A target may have nothing to send or receive (duplicated heads: only one
// of the context ranks holding a head sends it; see NewPlan). It is listed
// all the same, so both sides agree on who talks to whom: a generation rank
// asks every context rank in its list, and a context rank can release the
// request once every generation rank in its list has asked and been served.
//
// With attention DP on the self side, selfRank must be in DP group
// self.Parallel.DPRank; on the peer side the ranks returned are in DP group
// peer.Parallel.DPRank.
func TargetRanks(peer, self CacheState, selfRank int) ([]int, error) {
	if err := checkPair(peer, self); err != nil {
		return nil, err
	}
	sp, err := self.locate("self", selfRank)
	if err != nil {
		return nil, err
	}
	pc := peer.Parallel
	ppLo, ppHi := -1, -1
	lo := 0
	for k, n := range pc.StageLayerCounts(peer.Shape.Layers) {
		if lo < sp.hi && sp.lo < lo+n {
			if ppLo < 0 {
				ppLo = k
			}
			ppHi = k + 1
		}
		lo += n
	}
	peerN := pc.TPPerDP()
	tpLo, tpHi := tpOverlap(sp.local, sp.tpPerDP, peerN)
	base := 0
	if pc.AttentionDP {
		base = pc.DPRank * peerN
	}
	out := make([]int, 0, (tpHi-tpLo)*(ppHi-ppLo))
	for t := tpLo; t < tpHi; t++ {
		for k := ppLo; k < ppHi; k++ {
			out = append(out, pc.Rank(k, 0, base+t))
		}
	}
	return out, nil
}
