package engine

import (
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/kvcache"
)

// KVEventType names a KV cache event as TensorRT-LLM's KV cache event API
// does.
type KVEventType string

// The KV cache event types.
const (
	// KVEventCreated opens an engine's event stream: the pool's size.
	KVEventCreated KVEventType = "created"
	// KVEventStored says full blocks were published for reuse.
	KVEventStored KVEventType = "stored"
	// KVEventRemoved says blocks left the reuse index (evicted).
	KVEventRemoved KVEventType = "removed"
)

// KVEvent is one change of an engine's reusable KV cache, as a router that
// routes by cached prefix needs it. The hashes are kvcache.BlockHash chains
// over the prompt's token ids, so a reader that knows a prompt's tokens can
// compute the hashes of its blocks itself (from kvcache.RootHash of the
// request's cache salt: the zero Hash without one).
type KVEvent struct {
	// ID increases by one per event, from 1, over the engine's life.
	ID   uint64
	Type KVEventType
	// ParentHash (stored) is the hash of the block before Hashes[0]; the
	// root (kvcache.RootHash of the cache salt) when Hashes[0] is a
	// sequence's first block.
	ParentHash kvcache.Hash
	// Hashes are the stored or removed blocks, in token order for stored.
	Hashes []kvcache.Hash
	// NumBlocks (created) is the number of blocks of each rank's pool.
	NumBlocks int
}

// eventRing is the engine's bounded buffer of KV cache events: the last
// max events. Safe for concurrent use.
type eventRing struct {
	mu   sync.Mutex
	max  int
	buf  []KVEvent // ring of the last len(buf) events
	head int       // index in buf of the oldest event
	next uint64    // ID of the next event
}

func newEventRing(max int) *eventRing { return &eventRing{max: max, next: 1} }

// add appends ev with the next ID, dropping the oldest event when the ring
// is full. With a zero bound it keeps nothing.
func (q *eventRing) add(ev KVEvent) {
	if q == nil || q.max <= 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	ev.ID = q.next
	q.next++
	if len(q.buf) < q.max {
		q.buf = append(q.buf, ev)
		return
	}
	q.buf[q.head] = ev
	q.head = (q.head + 1) % len(q.buf)
}

// after returns copies of the events with IDs above after, oldest first,
// and whether events above after were dropped before it could read them.
func (q *eventRing) after(after uint64) ([]KVEvent, bool) {
	if q == nil || q.max <= 0 {
		return nil, false
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	oldest := q.next - uint64(len(q.buf)) // ID of buf[head]
	lost := after+1 < oldest
	var out []KVEvent
	for i := range q.buf {
		ev := q.buf[(q.head+i)%len(q.buf)]
		if ev.ID <= after {
			continue
		}
		ev.Hashes = slices.Clone(ev.Hashes)
		out = append(out, ev)
	}
	return out, lost
}

// KVEvents returns the events after event id after, oldest first, and lost:
// whether some of them were dropped because the bounded event buffer
// (kv_cache_config.event_buffer_max_size, Options.EventBufferMaxSize)
// overflowed, so the reader must forget what it knew of this engine and
// rebuild from what follows. With a zero buffer size no events are kept and
// it returns none. The events are rank 0's pool: every rank publishes the
// same hashes, but the ranks' pools may evict differently. Safe for
// concurrent use.
func (e *Engine) KVEvents(after uint64) (events []KVEvent, lost bool) {
	return e.events.after(after)
}

// CachedPrefix returns how many of prompt's first tokens a request without
// a cache salt would find in the engine's reusable KV cache now, as
// admission would reuse them (and so neither compute nor receive): whole
// cached blocks common to every rank, plus, with partial reuse, the
// matching tokens of the next cached block (one nobody holds, without copy
// on partial reuse); never the whole prompt, since
// its last token is always computed. It pins nothing and is safe for
// concurrent use; the answer can be stale by the time the request arrives.
// It is 0 without block reuse.
func (e *Engine) CachedPrefix(prompt []int32) int {
	return e.CachedPrefixSalted(prompt, "")
}

// CachedPrefixSalted is CachedPrefix for a request with cache salt salt
// (Request.CacheSalt).
func (e *Engine) CachedPrefixSalted(prompt []int32, salt string) int {
	if !e.opts.BlockReuse {
		return 0
	}
	root := kvcache.RootHash(salt)
	maxFull, _ := e.reuseLimits(0, len(prompt))
	return e.peekCached(prompt, root, kvcache.HashBlocks(root, prompt[:maxFull*e.inst.tpb], e.inst.tpb))
}

// peekCached is CachedPrefixSalted for a prompt whose chained block hashes
// from root are known (hs: at least its blocks admission may reuse; more
// are ignored). It pins nothing.
func (e *Engine) peekCached(prompt []int32, root kvcache.Hash, hs []kvcache.Hash) int {
	maxFull, partial := e.reuseLimits(0, len(prompt))
	if !e.opts.BlockReuse {
		return 0
	}
	tpb := e.inst.tpb
	hs = hs[:min(len(hs), maxFull)]
	common := len(hs)
	for _, p := range e.inst.pools {
		common = min(common, p.PeekPrefix(hs))
	}
	n := common * tpb
	if !partial {
		return n
	}
	rest := prompt[n:]
	limit := min(tpb, len(rest)-1)
	if limit < 1 {
		return n
	}
	parent := root
	if common > 0 {
		parent = hs[common-1]
	}
	return n + e.inst.pools[0].PeekPartial(parent, rest[:limit], !e.opts.CopyOnPartialReuse)
}
