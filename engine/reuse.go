package engine

import (
	"slices"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver"
)

// reuseMatch is what admission found of a request's prompt in the pools:
// the blocks of its cached full-block prefix on every rank, and optionally
// a cached block whose first k tokens match the prompt's next ones: shared,
// to be copied into the request's own next block, or taken (out of the
// index, nobody else holding it) to become that block. Every block listed
// is pinned by the match until adopted or dropped.
type reuseMatch struct {
	full  [][]kvcache.BlockID // [rank][block]: the same number on every rank
	src   []kvcache.BlockID   // [rank]: the partial block; nil for none
	k     int                 // tokens of src the prompt shares
	taken bool                // src is the request's own: no copy
}

// drop releases every block the match still holds (adopt takes the full
// ones).
func (m *reuseMatch) drop(pools []*kvcache.Pool) {
	for r, p := range pools {
		if m.full != nil && len(m.full[r]) > 0 {
			p.Release(reversed(m.full[r])...)
		}
		if m.src != nil {
			p.Release(m.src[r])
		}
	}
	*m = reuseMatch{}
}

// reuseLimits returns how many full blocks of a prompt of P tokens
// admission may reuse, and whether it may also reuse part of the next
// block: at least the last prompt token is always computed (its logits
// give the first token) or, for generation_only, received, so that no
// shared block is ever written and a transfer asks for one block at least.
// Partial blocks are never reused by a generation_only request (its next
// block arrives whole from the context instance).
func (e *Engine) reuseLimits(typ transceiver.RequestType, P int) (maxFull int, partial bool) {
	if !e.opts.BlockReuse || P == 0 {
		return 0, false
	}
	return (P - 1) / e.inst.tpb, e.opts.PartialReuse && typ != transceiver.GenerationOnly
}

// matchPrefix pins, on every rank, the longest cached prefix of r's
// prompt that admission may reuse (the common length over the ranks, whose
// pools may have evicted differently), and the partial block after it.
func (e *Engine) matchPrefix(r *request) reuseMatch {
	P, tpb := len(r.prompt), e.inst.tpb
	maxFull, partial := e.reuseLimits(r.typ, P)
	if !e.opts.BlockReuse {
		return reuseMatch{}
	}
	pools := e.inst.pools
	hs := r.hashes[:min(len(r.hashes), maxFull)]
	m := reuseMatch{full: make([][]kvcache.BlockID, len(pools))}
	common := len(hs)
	for i, p := range pools {
		m.full[i] = p.MatchPrefix(hs)
		common = min(common, len(m.full[i]))
	}
	for i, p := range pools {
		if extra := m.full[i][common:]; len(extra) > 0 {
			p.Release(reversed(extra)...)
		}
		m.full[i] = m.full[i][:common:common]
	}
	if !partial {
		return m
	}
	rest := r.prompt[common*tpb:]
	limit := min(tpb, len(rest)-1)
	if limit < 1 {
		return m
	}
	parent := r.root
	if common > 0 {
		parent = hs[common-1]
	}
	// With copy on partial reuse the block is shared and copied; without,
	// only a block nobody holds is reused, taken out of the index.
	take := !e.opts.CopyOnPartialReuse
	var id kvcache.BlockID
	var h kvcache.Hash
	var k int
	var ok bool
	if take {
		id, h, k, ok = pools[0].TakePartial(parent, rest[:limit])
	} else {
		id, h, k, ok = pools[0].MatchPartial(parent, rest[:limit])
	}
	if !ok {
		return m
	}
	src := append(make([]kvcache.BlockID, 0, len(pools)), id)
	for _, p := range pools[1:] {
		if take {
			id, ok = p.TakeCached(h)
		} else {
			id, ok = p.Lookup(h)
		}
		if !ok {
			// Taken blocks released are free: they left the index.
			for i, s := range src {
				pools[i].Release(s)
			}
			return m
		}
		src = append(src, id)
	}
	m.src, m.k, m.taken = src, k, take
	return m
}

// adopt makes the match's full blocks the first blocks of s (which must be
// empty), and a taken partial block the next, and its length their tokens;
// the match keeps only a shared partial block, for copyPartial.
func (s *Sequence) adopt(m *reuseMatch) {
	if m.full == nil {
		return
	}
	for r := range s.blocks {
		s.blocks[r] = append(s.blocks[r][:0], m.full[r]...)
	}
	s.n = len(m.full[0]) * s.in.tpb
	m.full = nil
	if m.taken {
		for r := range s.blocks {
			s.blocks[r] = append(s.blocks[r], m.src[r])
		}
		s.n += m.k
		m.src, m.k, m.taken = nil, 0, false
	}
}

// copyPartial copies the match's partial block into the sequence's next
// block on every rank (copy on partial reuse), releases it, and counts
// its matching tokens into the sequence. The sequence must have reserved
// that block; its tokens from k on are written by the prefill or zeroed
// after it.
func (s *Sequence) copyPartial(m *reuseMatch) {
	if m.src == nil {
		return
	}
	i := s.n / s.in.tpb
	for r, p := range s.in.pools {
		copy(p.Block(s.blocks[r][i]), p.Block(m.src[r]))
		p.Release(m.src[r])
	}
	s.n += m.k
	m.src, m.k = nil, 0
}

// commitBlocks publishes in every rank's reuse index the full blocks of
// r's sequence that hold toks (the tokens whose KV the sequence holds, from
// the first) and were not published yet, and records a stored event for
// each run of blocks rank 0 indexed anew. A block whose hash another block
// already holds stays unindexed and is freed with the request.
func (e *Engine) commitBlocks(r *request, toks []int32) {
	if !e.opts.BlockReuse || r.seq == nil {
		return
	}
	tpb := e.inst.tpb
	full := min(len(toks), r.seq.n) / tpb
	parentOf := func(i int) kvcache.Hash {
		if i == 0 {
			return r.root
		}
		return r.hashes[i-1]
	}
	for i := len(r.hashes); i < full; i++ {
		r.hashes = append(r.hashes, kvcache.BlockHash(parentOf(i), toks[i*tpb:(i+1)*tpb]))
	}
	var run []kvcache.Hash
	runParent := kvcache.Hash{}
	flush := func() {
		if len(run) > 0 {
			e.events.add(KVEvent{Type: KVEventStored, ParentHash: runParent, Hashes: run})
			run = nil
		}
	}
	for i := r.published; i < full; i++ {
		parent := parentOf(i)
		block := toks[i*tpb : (i+1)*tpb]
		for rank, p := range e.inst.pools {
			h, ok, err := p.CommitTokens(r.seq.blocks[rank][i], parent, block)
			if err != nil {
				e.log.Error("publish block", "request", r.id, "rank", rank, "block", i, "err", err)
				continue
			}
			if rank != 0 {
				continue
			}
			if !ok {
				flush()
				continue
			}
			e.reuse.published++
			if len(run) == 0 {
				runParent = parent
			}
			run = append(run, h)
		}
	}
	flush()
	r.published = max(r.published, full)
}

// drainEvictions records a removed event for the blocks rank 0's pool
// evicted since the last call.
func (e *Engine) drainEvictions() {
	if e.opts.EventBufferMaxSize <= 0 {
		return
	}
	hs, _ := e.inst.pools[0].DrainEvicted(nil)
	if len(hs) > 0 {
		e.events.add(KVEvent{Type: KVEventRemoved, Hashes: hs})
	}
}

// reversed returns a reversed copy of ids: blocks released last first, so
// that a prefix's tail is evicted before the blocks it extends.
func reversed(ids []kvcache.BlockID) []kvcache.BlockID {
	r := slices.Clone(ids)
	slices.Reverse(r)
	return r
}
