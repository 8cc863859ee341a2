package kvcache

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
)

// BlockID identifies a block of a Pool: an index in [0, NumBlocks). Ids are
// local to their pool and process; they never cross the wire (a transfer
// names "the request's blocks, in order").
type BlockID int32

// MaxBlocks is the largest number of blocks in one Pool.
const MaxBlocks = math.MaxInt32 - 1

// blockState is where a block is. Every block is in exactly one state.
type blockState uint8

const (
	stateFree   blockState = iota // refcount 0, not indexed, on the free stack
	statePinned                   // refcount > 0, maybe indexed
	stateCached                   // refcount 0, indexed, on the LRU list
)

// Pool is the paged KV cache of one rank: NumBlocks blocks of one
// BlockLayout, carved in order out of one contiguous Arena. Block i occupies
// bytes [i×BlockBytes, (i+1)×BlockBytes) of the arena.
//
// Blocks are refcounted. Allocate hands out blocks with a refcount of one,
// Retain adds references, Release drops them. A block with references is
// pinned: its memory is the holders' to read and write, and the pool will
// neither hand it out again nor evict it. A newly allocated block holds
// whatever its previous user left there; the pool never zeroes memory.
//
// A pinned block whose contents are final (a full block of a prompt) can be
// committed to the prefix-reuse index under its Hash. When the last
// reference to a committed block is released, the block becomes cached
// rather than free: it keeps its contents and Lookup or MatchPrefix can pin
// it again. Allocate takes clean free blocks first and then evicts cached
// blocks, least recently released first; eviction removes the hash from the
// index, so a block is never found by hash once it has been handed out
// again. Committed blocks are shared by every request that finds them: their
// holders must treat them as read-only.
//
// Misuse (releasing a block more often than it was referenced, using an id
// out of range or a block that is not pinned) returns an error wrapping
// ErrDoubleFree or ErrBadBlock and changes nothing; built with the
// invariants tag, it panics instead, and every operation checks the pool's
// internal consistency.
//
// A Pool is safe for concurrent use. All bookkeeping is under one mutex;
// Block and BlockOffset take no lock. The pool starts no goroutines and
// reads no clock.
type Pool struct {
	layout     BlockLayout
	blockBytes int64
	arena      Arena
	mem        []byte         // the arena's bytes, NumBlocks×BlockBytes long; never changes
	refs       []atomic.Int32 // written under mu; read without it by Block and BlockOffset
	closed     atomic.Bool    // written under mu

	mu         sync.Mutex
	state      []blockState
	committed  []bool  // block is in index under hashes[id]
	hashes     []Hash  // valid where committed
	prev, next []int32 // LRU list of cached blocks, oldest first; element NumBlocks is the sentinel
	free       []BlockID
	index      map[Hash]BlockID
	numPinned  int
	numCached  int
	evictions  uint64
	hits       uint64
	misses     uint64

	// The partial-reuse index (CommitTokens, MatchPartial): each block's
	// parent hash and tokens, and the children of each parent. Allocated on
	// the first CommitTokens.
	toks     []int32 // [NumBlocks][TokensPerBlock]
	parents  []Hash
	hasToks  []bool
	children map[Hash][]BlockID

	// The eviction record (TrackEvictions, DrainEvicted).
	trackEvict bool
	evictLost  bool
	evicted    []Hash
}

// NewPool allocates an arena of numBlocks blocks of layout from alloc (the
// Go heap when alloc is nil) and returns a pool with every block free. The
// pool owns the arena and closes it in Close.
func NewPool(layout BlockLayout, numBlocks int, alloc Allocator) (*Pool, error) {
	if err := layout.Validate(); err != nil {
		return nil, err
	}
	if numBlocks <= 0 || numBlocks > MaxBlocks {
		return nil, fmt.Errorf("kvcache: pool of %d blocks, want 1..%d", numBlocks, MaxBlocks)
	}
	bb, ok := mulPositive(int64(layout.Layers), int64(layout.KVFactor), int64(layout.Heads),
		int64(layout.TokensPerBlock), int64(layout.HeadDim), int64(layout.ElemSize))
	size, ok2 := mulPositive(bb, int64(numBlocks))
	if !ok || !ok2 || size > maxArenaSize {
		return nil, fmt.Errorf("%w: %d blocks of %+v do not fit in one arena (at most %d bytes)",
			ErrInvalidShape, numBlocks, layout, int64(maxArenaSize))
	}
	if alloc == nil {
		alloc = HeapAllocator{}
	}
	a, err := alloc.Allocate(int(size))
	if err != nil {
		return nil, err
	}
	mem := a.Bytes()
	if int64(len(mem)) != size {
		a.Close()
		return nil, fmt.Errorf("kvcache: allocator %T returned %d bytes, want %d", alloc, len(mem), size)
	}
	n := numBlocks
	p := &Pool{
		layout:     layout,
		blockBytes: bb,
		arena:      a,
		mem:        mem,
		refs:       make([]atomic.Int32, n),
		state:      make([]blockState, n),
		committed:  make([]bool, n),
		hashes:     make([]Hash, n),
		prev:       make([]int32, n+1),
		next:       make([]int32, n+1),
		free:       make([]BlockID, n),
		index:      make(map[Hash]BlockID, n),
	}
	p.prev[n], p.next[n] = int32(n), int32(n)
	// Push in reverse so that a fresh pool hands out 0, 1, 2, ...
	for i := range p.free {
		p.free[i] = BlockID(n - 1 - i)
	}
	return p, nil
}

// mulPositive multiplies positive factors, reporting false on overflow or a
// non-positive factor.
func mulPositive(xs ...int64) (int64, bool) {
	r := int64(1)
	for _, x := range xs {
		if x <= 0 || r > math.MaxInt64/x {
			return 0, false
		}
		r *= x
	}
	return r, true
}

// Layout returns the layout of every block.
func (p *Pool) Layout() BlockLayout { return p.layout }

// NumBlocks returns the number of blocks in the pool.
func (p *Pool) NumBlocks() int { return len(p.refs) }

// BlockBytes returns the size of one block in bytes.
func (p *Pool) BlockBytes() int64 { return p.blockBytes }

// Arena returns the arena behind the pool, for a backend to register as one
// memory region (or, for a *ShmArena, to share its File with a peer). The
// pool keeps ownership: callers must not Close it, and must stop using it
// once the pool is closed.
func (p *Pool) Arena() Arena { return p.arena }

// Block returns the memory of pinned block id: a slice of the arena, with
// its capacity limited to the block, so appending to it can never spill into
// the next block. It takes no lock and does not allocate.
//
// Block returns nil if id is out of range, not pinned, or the pool is
// closed (and panics in the first two cases under the invariants tag). The
// slice must not be used after the caller's reference is released.
func (p *Pool) Block(id BlockID) []byte {
	if !p.usable("use", id) {
		return nil
	}
	return p.slice(id)
}

// slice is block id's memory, its capacity limited to the block.
func (p *Pool) slice(id BlockID) []byte {
	off := int64(id) * p.blockBytes
	end := off + p.blockBytes
	return p.mem[off:end:end]
}

// Blocks returns the memory of pinned blocks ids, in order, as Block
// does; where Block would return nil it returns an error (a *BlockError
// wrapping ErrBadBlock, or ErrClosed) naming the first such block, and
// does not panic under the invariants tag: the ids may be a caller's
// input, checked here.
func (p *Pool) Blocks(ids []BlockID) ([][]byte, error) {
	mem := make([][]byte, len(ids))
	for i, id := range ids {
		switch {
		case p.closed.Load():
			return nil, ErrClosed
		case uint32(id) >= uint32(len(p.refs)):
			return nil, p.outOfRange("use", id)
		case p.refs[id].Load() <= 0:
			return nil, &BlockError{Op: "use", ID: id, Err: errNotPinned}
		}
		mem[i] = p.slice(id)
	}
	return mem, nil
}

// BlockOffset returns the byte offset of pinned block id in the arena
// (id × BlockBytes), for a backend that addresses blocks inside a
// registered region (RMA) or a peer's shared mapping. Like Block, it
// returns -1 if id is out of range, not pinned, or the pool is closed.
func (p *Pool) BlockOffset(id BlockID) int64 {
	if !p.usable("offset of", id) {
		return -1
	}
	return int64(id) * p.blockBytes
}

// usable reports whether id may be used without the lock: in range,
// pinned, pool open. It panics on misuse under the invariants tag.
func (p *Pool) usable(op string, id BlockID) bool {
	if p.closed.Load() {
		return false
	}
	if uint32(id) >= uint32(len(p.refs)) {
		if invariants {
			panic(p.outOfRange(op, id))
		}
		return false
	}
	if p.refs[id].Load() <= 0 {
		if invariants {
			panic(&BlockError{Op: op, ID: id, Err: errNotPinned})
		}
		return false
	}
	return true
}

var errNotPinned = fmt.Errorf("%w (not pinned)", ErrBadBlock)

func (p *Pool) outOfRange(op string, id BlockID) error {
	return &BlockError{Op: op, ID: id, Err: fmt.Errorf("%w (out of range [0, %d))", ErrBadBlock, len(p.refs))}
}

// Allocate pins n blocks and returns their ids: clean free blocks first,
// then cached blocks evicted least recently released first. It is
// all-or-nothing: if fewer than n blocks are available it returns an error
// wrapping ErrPoolExhausted and allocates none. Allocate(0) returns no
// blocks and no error.
func (p *Pool) Allocate(n int) ([]BlockID, error) { return p.AppendAllocate(nil, n) }

// AppendAllocate is Allocate appending the ids to dst, which spares the
// allocation of a new slice when dst has room. It returns dst unchanged on
// error.
func (p *Pool) AppendAllocate(dst []BlockID, n int) ([]BlockID, error) {
	if n < 0 {
		return dst, misuse(fmt.Errorf("kvcache: allocate %d blocks: negative count", n))
	}
	orig := dst
	if n <= len(p.refs) {
		dst = slices.Grow(dst, n) // outside the lock
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return orig, ErrClosed
	}
	if avail := len(p.free) + p.numCached; n > avail {
		return orig, fmt.Errorf("%w: want %d blocks, %d available (%d free, %d cached) of %d",
			ErrPoolExhausted, n, avail, len(p.free), p.numCached, len(p.refs))
	}
	for range n {
		var id BlockID
		if k := len(p.free); k > 0 {
			id = p.free[k-1]
			p.free = p.free[:k-1]
		} else {
			id = p.evictLocked()
		}
		p.state[id] = statePinned
		p.refs[id].Store(1)
		dst = append(dst, id)
	}
	p.numPinned += n
	p.checkInvariantsLocked()
	return dst, nil
}

// evictLocked removes the least recently released cached block from the
// LRU list and the index and returns it, unpinned. There must be one.
func (p *Pool) evictLocked() BlockID {
	id := BlockID(p.next[len(p.refs)])
	p.unlinkLocked(id)
	delete(p.index, p.hashes[id])
	p.dropChildLocked(id)
	p.recordEvictionLocked(p.hashes[id])
	p.committed[id] = false
	p.hashes[id] = Hash{}
	p.numCached--
	p.evictions++
	return id
}

// Retain adds one reference to each of ids (twice for an id listed twice).
// Every id must already be pinned: a caller can only share a reference it
// holds. (A released block may have been evicted and reallocated since; the
// way to pin a cached block again is Lookup or MatchPrefix.) On error
// nothing is retained.
func (p *Pool) Retain(ids ...BlockID) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return ErrClosed
	}
	for _, id := range ids {
		if err := p.checkPinnedLocked("retain", id); err != nil {
			return misuse(err)
		}
	}
	for _, id := range ids {
		p.refs[id].Add(1)
	}
	p.checkInvariantsLocked()
	return nil
}

// Release drops one reference to each of ids (two for an id listed twice),
// as if released one at a time in the order given. A block whose last
// reference goes becomes cached if it is committed to the reuse index, and
// free otherwise. Cached blocks are evicted in the order they were
// released: list a request's blocks last first (as BlockTable.Release
// does) so that the tail of a prefix is evicted before the blocks it
// depends on.
//
// Releasing a block more times than it is referenced returns an error
// wrapping ErrDoubleFree; an id out of range, one wrapping ErrBadBlock. On
// error nothing is released.
func (p *Pool) Release(ids ...BlockID) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return ErrClosed
	}
	// Pass 1 drops the references, undoing them all if one is bad.
	for i, id := range ids {
		var err error
		if uint32(id) >= uint32(len(p.refs)) {
			err = p.outOfRange("release", id)
		} else if p.refs[id].Load() <= 0 {
			err = &BlockError{Op: "release", ID: id, Err: ErrDoubleFree}
		}
		if err != nil {
			for _, done := range ids[:i] {
				p.refs[done].Add(1)
			}
			return misuse(err)
		}
		p.refs[id].Add(-1)
	}
	// Pass 2 moves the blocks that lost their last reference, each once,
	// in the order in which they lost it: walking backwards, a block is met
	// first at its last occurrence, and each cached block is inserted after
	// the old tail of the LRU list, before the ones that come later in ids.
	// So Release(a, b) is the same as Release(a); Release(b).
	anchor := p.prev[len(p.refs)]
	for _, id := range slices.Backward(ids) {
		if p.refs[id].Load() != 0 || p.state[id] != statePinned {
			continue
		}
		p.numPinned--
		if p.committed[id] {
			p.state[id] = stateCached
			p.insertAfterLocked(anchor, id)
			p.numCached++
		} else {
			p.state[id] = stateFree
			p.free = append(p.free, id)
		}
	}
	p.checkInvariantsLocked()
	return nil
}

// Commit adds pinned block id to the reuse index under h, the BlockHash of
// its tokens and their prefix; the block's contents must be final. It
// reports whether id is now the block indexed under h: false, with no
// error, when another block already is (the first committed block wins and
// id stays unindexed, to be freed when released). Committing a block again
// under the same hash is a no-op; under another hash, an error wrapping
// ErrCommitted.
func (p *Pool) Commit(id BlockID, h Hash) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return false, ErrClosed
	}
	if err := p.checkPinnedLocked("commit", id); err != nil {
		return false, misuse(err)
	}
	if p.committed[id] {
		if p.hashes[id] != h {
			return false, misuse(&BlockError{Op: "commit", ID: id, Err: ErrCommitted})
		}
		return true, nil
	}
	if _, ok := p.index[h]; ok {
		return false, nil
	}
	p.index[h] = id
	p.hashes[id] = h
	p.committed[id] = true
	p.checkInvariantsLocked()
	return true, nil
}

// Lookup finds the block committed under h and pins it (adds a reference,
// which the caller must Release). It reports false if no block is indexed
// under h, or the pool is closed.
func (p *Pool) Lookup(h Hash) (BlockID, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return 0, false
	}
	id, ok := p.lookupLocked(h)
	p.checkInvariantsLocked()
	return id, ok
}

// MatchPrefix pins the blocks of the longest cached prefix of a sequence
// whose chained block hashes are hashes (from HashBlocks, root parent) and
// returns them in order: the block of hashes[0], of hashes[1], ... up to
// the first hash not in the index. The caller must Release every returned
// block. It returns nil when nothing matches or the pool is closed.
func (p *Pool) MatchPrefix(hashes []Hash) []BlockID {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return nil
	}
	var ids []BlockID
	for i, h := range hashes {
		id, ok := p.lookupLocked(h)
		if !ok {
			break
		}
		if ids == nil {
			ids = make([]BlockID, 0, len(hashes)-i)
		}
		ids = append(ids, id)
	}
	p.checkInvariantsLocked()
	return ids
}

func (p *Pool) lookupLocked(h Hash) (BlockID, bool) {
	id, ok := p.index[h]
	if !ok {
		p.misses++
		return 0, false
	}
	p.hits++
	if p.state[id] == stateCached {
		p.unlinkLocked(id)
		p.numCached--
		p.numPinned++
		p.state[id] = statePinned
	}
	p.refs[id].Add(1)
	return id, true
}

func (p *Pool) checkPinnedLocked(op string, id BlockID) error {
	if uint32(id) >= uint32(len(p.refs)) {
		return p.outOfRange(op, id)
	}
	if p.state[id] != statePinned {
		return &BlockError{Op: op, ID: id, Err: errNotPinned}
	}
	return nil
}

// insertAfterLocked links id into the LRU list after at (a cached block or
// the sentinel).
func (p *Pool) insertAfterLocked(at int32, id BlockID) {
	next := p.next[at]
	p.prev[id], p.next[id] = at, next
	p.next[at] = int32(id)
	p.prev[next] = int32(id)
}

func (p *Pool) unlinkLocked(id BlockID) {
	prev, next := p.prev[id], p.next[id]
	p.next[prev] = next
	p.prev[next] = prev
	p.prev[id], p.next[id] = -1, -1
}

// FreeBlocks returns the number of blocks Allocate can hand out now: clean
// free blocks plus cached blocks, which are evicted on demand. It equals
// Stats().Available().
func (p *Pool) FreeBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.free) + p.numCached
}

// CachedBlocks returns the number of unpinned blocks held in the reuse
// index. They are counted by FreeBlocks too.
func (p *Pool) CachedBlocks() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.numCached
}

// Stats is a snapshot of a pool's counts. Free + Cached + Pinned == Total
// always. A leak check compares Pinned (or Available) with its value
// before the code under test ran.
type Stats struct {
	Total  int // blocks in the pool
	Free   int // clean blocks: unpinned and not indexed
	Cached int // unpinned blocks kept for reuse; evicted by Allocate on demand
	Pinned int // blocks with a refcount above zero

	Indexed   int    // blocks in the reuse index: Cached plus committed pinned blocks
	Evictions uint64 // cached blocks evicted by Allocate, since NewPool
	Hits      uint64 // blocks found by Lookup and MatchPrefix, since NewPool
	Misses    uint64 // hashes Lookup and MatchPrefix did not find, since NewPool
}

// Available returns the number of blocks Allocate can hand out: Free +
// Cached.
func (s Stats) Available() int { return s.Free + s.Cached }

// Stats returns a snapshot of the pool's counts. It works after Close too,
// reporting the counts at the time of closing.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{
		Total:     len(p.refs),
		Free:      len(p.free),
		Cached:    p.numCached,
		Pinned:    p.numPinned,
		Indexed:   len(p.index),
		Evictions: p.evictions,
		Hits:      p.hits,
		Misses:    p.misses,
	}
}

// Close releases the arena and makes every later operation fail with
// ErrClosed (Block returns nil). It is idempotent: later calls return nil.
//
// Close releases the arena even if blocks are still pinned, and then
// returns an error wrapping ErrBlocksInUse with their number, so that leak
// checks fail loudly. Holders of such blocks must not touch their memory
// again: for mmap and shm arenas the memory is gone and access faults.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed.Load() {
		return nil
	}
	p.closed.Store(true)
	var errs []error
	if p.numPinned > 0 {
		errs = append(errs, fmt.Errorf("%w: %d of %d blocks pinned at Close", ErrBlocksInUse, p.numPinned, len(p.refs)))
	}
	if err := p.arena.Close(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// checkInvariantsLocked panics if the pool is inconsistent, in builds with
// the invariants tag; it compiles to nothing otherwise.
func (p *Pool) checkInvariantsLocked() {
	if invariants {
		if err := p.consistencyLocked(); err != nil {
			panic(err)
		}
	}
}

// consistencyLocked checks every structural invariant of the pool. It is
// O(NumBlocks).
func (p *Pool) consistencyLocked() error {
	n := len(p.refs)
	var count [3]int
	for id := range n {
		st, refs := p.state[id], p.refs[id].Load()
		if int(st) >= len(count) {
			return fmt.Errorf("kvcache: invariant: block %d in state %d", id, st)
		}
		count[st]++
		if (st == statePinned) != (refs > 0) || refs < 0 {
			return fmt.Errorf("kvcache: invariant: block %d in state %d with refcount %d", id, st, refs)
		}
		if st == stateCached && !p.committed[id] || st == stateFree && p.committed[id] {
			return fmt.Errorf("kvcache: invariant: block %d in state %d, committed %v", id, st, p.committed[id])
		}
		if p.committed[id] && p.index[p.hashes[id]] != BlockID(id) {
			return fmt.Errorf("kvcache: invariant: committed block %d not indexed under its hash", id)
		}
	}
	if count[stateFree] != len(p.free) || count[statePinned] != p.numPinned || count[stateCached] != p.numCached {
		return fmt.Errorf("kvcache: invariant: states %v, want free %d pinned %d cached %d",
			count, len(p.free), p.numPinned, p.numCached)
	}
	onFree := make([]bool, n)
	for _, id := range p.free {
		if p.state[id] != stateFree || onFree[id] {
			return fmt.Errorf("kvcache: invariant: block %d on the free stack in state %d, or twice", id, p.state[id])
		}
		onFree[id] = true
	}
	cached := 0
	for id := p.next[n]; id != int32(n); id = p.next[id] {
		if cached++; cached > n || p.state[id] != stateCached || p.prev[p.next[id]] != id {
			return fmt.Errorf("kvcache: invariant: LRU list broken at block %d", id)
		}
	}
	if cached != p.numCached {
		return fmt.Errorf("kvcache: invariant: LRU list holds %d blocks, want %d", cached, p.numCached)
	}
	for h, id := range p.index {
		if uint32(id) >= uint32(n) || !p.committed[id] || p.hashes[id] != h {
			return fmt.Errorf("kvcache: invariant: index entry %v → block %d is stale", h, id)
		}
	}
	kids := 0
	for par, ids := range p.children {
		for _, id := range ids {
			if !p.hasToks[id] || !p.committed[id] || p.parents[id] != par {
				return fmt.Errorf("kvcache: invariant: partial index entry %v → block %d is stale", par, id)
			}
		}
		kids += len(ids)
	}
	for id := range p.hasToks {
		if p.hasToks[id] {
			kids--
		}
	}
	if kids != 0 {
		return fmt.Errorf("kvcache: invariant: partial index lists %d blocks more than have tokens", kids)
	}
	return nil
}
