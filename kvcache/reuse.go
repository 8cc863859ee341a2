package kvcache

import (
	"crypto/sha256"
	"fmt"
	"slices"
)

// saltDomain separates the hash of a cache salt from block hashes.
const saltDomain = "kvxfer/kvcache/salt/v1\x00"

// RootHash returns the parent hash of a sequence's first block for a cache
// salt (vLLM's cache_salt: tenants with different salts never share a
// block): the zero Hash for the empty salt, otherwise the first 16 bytes of
// SHA-256(salt domain ‖ salt), which no block hash can equal short of a
// SHA-256 collision.
func RootHash(salt string) Hash {
	if salt == "" {
		return Hash{}
	}
	sum := sha256.Sum256(append([]byte(saltDomain), salt...))
	return Hash(sum[:len(Hash{})])
}

// CommitTokens is Commit that also records the block's parent hash and its
// tokens (exactly TokensPerBlock of them, copied), so that MatchPartial can
// find the block by a prefix of its tokens. h must be
// BlockHash(parent, tokens). The partial entry lives and dies with the
// index entry: eviction removes both.
func (p *Pool) CommitTokens(id BlockID, parent Hash, tokens []int32) (Hash, bool, error) {
	tpb := p.layout.TokensPerBlock
	if len(tokens) != tpb {
		return Hash{}, false, misuse(fmt.Errorf("kvcache: commit block %d with %d tokens, want %d", id, len(tokens), tpb))
	}
	h := BlockHash(parent, tokens)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return h, false, ErrClosed
	}
	if err := p.checkPinnedLocked("commit", id); err != nil {
		return h, false, misuse(err)
	}
	if p.committed[id] {
		if p.hashes[id] != h {
			return h, false, misuse(&BlockError{Op: "commit", ID: id, Err: ErrCommitted})
		}
		return h, true, nil
	}
	if _, ok := p.index[h]; ok {
		return h, false, nil
	}
	p.index[h] = id
	p.hashes[id] = h
	p.committed[id] = true
	if p.toks == nil {
		p.toks = make([]int32, len(p.refs)*tpb)
		p.parents = make([]Hash, len(p.refs))
		p.hasToks = make([]bool, len(p.refs))
		p.children = make(map[Hash][]BlockID)
	}
	copy(p.toks[int(id)*tpb:], tokens)
	p.parents[id] = parent
	p.hasToks[id] = true
	p.children[parent] = append(p.children[parent], id)
	p.checkInvariantsLocked()
	return h, true, nil
}

// dropChildLocked removes evicted block id from the partial index.
func (p *Pool) dropChildLocked(id BlockID) {
	if p.hasToks == nil || !p.hasToks[id] {
		return
	}
	p.hasToks[id] = false
	par := p.parents[id]
	kids := slices.DeleteFunc(p.children[par], func(c BlockID) bool { return c == id })
	if len(kids) == 0 {
		delete(p.children, par)
	} else {
		p.children[par] = kids
	}
	p.parents[id] = Hash{}
}

// bestChildLocked returns the child of parent (committed with
// CommitTokens; only cached ones if unused) whose tokens share the longest
// prefix with tokens, and that length; the first such child on a tie; ok
// false when no child shares a token.
func (p *Pool) bestChildLocked(parent Hash, tokens []int32, unused bool) (id BlockID, n int, ok bool) {
	tpb := p.layout.TokensPerBlock
	for _, c := range p.children[parent] {
		if unused && p.state[c] != stateCached {
			continue
		}
		own := p.toks[int(c)*tpb : int(c+1)*tpb]
		k := 0
		for k < len(tokens) && k < tpb && own[k] == tokens[k] {
			k++
		}
		if k > n {
			id, n, ok = c, k, true
		}
	}
	return id, n, ok
}

// MatchPartial finds the block committed with CommitTokens under parent
// whose first tokens match the most leading tokens of tokens, pins it (the
// caller must Release it) and returns it, its hash and the number of
// matching tokens (at most len(tokens) and TokensPerBlock). It reports
// false when no such block shares a first token, or the pool is closed.
// The block is shared: a caller that wants to extend it copies it into a
// block of its own (copy on partial reuse).
func (p *Pool) MatchPartial(parent Hash, tokens []int32) (BlockID, Hash, int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() || len(tokens) == 0 {
		return 0, Hash{}, 0, false
	}
	id, n, ok := p.bestChildLocked(parent, tokens, false)
	if !ok {
		return 0, Hash{}, 0, false
	}
	h := p.hashes[id]
	p.lookupLocked(h)
	p.checkInvariantsLocked()
	return id, h, n, true
}

// TakePartial is MatchPartial for a caller that will write the block in
// place: it considers only cached blocks (nobody holds them), and takes
// the one it finds out of the reuse index (as an eviction would, recorded
// for DrainEvicted) before pinning it for the caller, so that nobody finds
// it again.
func (p *Pool) TakePartial(parent Hash, tokens []int32) (BlockID, Hash, int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() || len(tokens) == 0 {
		return 0, Hash{}, 0, false
	}
	id, n, ok := p.bestChildLocked(parent, tokens, true)
	if !ok {
		return 0, Hash{}, 0, false
	}
	h := p.hashes[id]
	p.takeLocked(id)
	return id, h, n, true
}

// TakeCached takes the block indexed under h out of the index and pins it
// for the caller to write, if it is cached (nobody holds it); it reports
// false otherwise.
func (p *Pool) TakeCached(h Hash) (BlockID, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return 0, false
	}
	id, ok := p.index[h]
	if !ok || p.state[id] != stateCached {
		return 0, false
	}
	p.takeLocked(id)
	return id, true
}

// takeLocked evicts cached block id and pins it.
func (p *Pool) takeLocked(id BlockID) {
	p.unlinkLocked(id)
	delete(p.index, p.hashes[id])
	p.dropChildLocked(id)
	p.recordEvictionLocked(p.hashes[id])
	p.committed[id] = false
	p.hashes[id] = Hash{}
	p.numCached--
	p.numPinned++
	p.state[id] = statePinned
	p.refs[id].Store(1)
	p.checkInvariantsLocked()
}

// PeekPrefix returns how many leading hashes of hashes are in the index,
// as MatchPrefix would match them now, without pinning anything or
// touching the LRU order or the hit counts: a read-only estimate, stale as
// soon as the lock is dropped.
func (p *Pool) PeekPrefix(hashes []Hash) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return 0
	}
	for i, h := range hashes {
		if _, ok := p.index[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// PeekPartial returns the matching token count MatchPartial (or, if
// unused, TakePartial) would return now (0 for none), read-only like
// PeekPrefix.
func (p *Pool) PeekPartial(parent Hash, tokens []int32, unused bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return 0
	}
	_, n, _ := p.bestChildLocked(parent, tokens, unused)
	return n
}

// TrackEvictions makes the pool record the hash of every block it evicts
// from now on (on = true), for DrainEvicted, or stop and forget them. The
// record holds at most NumBlocks hashes: a caller drains it after each
// allocation, and an allocation evicts at most NumBlocks blocks; beyond that
// the oldest are dropped and DrainEvicted reports the loss.
func (p *Pool) TrackEvictions(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trackEvict = on
	p.evicted = p.evicted[:0]
	p.evictLost = false
}

// DrainEvicted appends the hashes of the blocks evicted since the last
// call, oldest first, to dst and forgets them; lost reports that more were
// evicted than the record holds (the oldest are missing).
func (p *Pool) DrainEvicted(dst []Hash) (hashes []Hash, lost bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	dst = append(dst, p.evicted...)
	lost = p.evictLost
	p.evicted, p.evictLost = p.evicted[:0], false
	return dst, lost
}

// recordEvictionLocked notes the eviction of a block indexed under h.
func (p *Pool) recordEvictionLocked(h Hash) {
	if !p.trackEvict {
		return
	}
	if len(p.evicted) >= len(p.refs) {
		p.evicted = append(p.evicted[:0], p.evicted[1:]...)
		p.evictLost = true
	}
	p.evicted = append(p.evicted, h)
}
