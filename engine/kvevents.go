package engine

import "github.com/kvxfer/kvxfer/kvcache"

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
// compute the hashes of its blocks itself.
type KVEvent struct {
	// ID increases by one per event, from 1, over the engine's life.
	ID   uint64
	Type KVEventType
	// ParentHash (stored) is the hash of the block before Hashes[0]; the
	// zero Hash when Hashes[0] is a sequence's first block.
	ParentHash kvcache.Hash
	// Hashes are the stored or removed blocks, in token order for stored.
	Hashes []kvcache.Hash
	// NumBlocks (created) is the number of blocks of each rank's pool.
	NumBlocks int
}

// KVEvents returns the events after event id after, oldest first, and lost:
// whether some of them were dropped because the bounded event buffer
// (kv_cache_config.event_buffer_max_size) overflowed, so the reader must
// forget what it knew of this engine and rebuild from what follows. Safe
// for concurrent use.
//
// The engine does not reuse blocks yet: it publishes none, and there are no
// events to return.
func (e *Engine) KVEvents(after uint64) (events []KVEvent, lost bool) {
	return nil, false
}

// CachedPrefix returns how many of prompt's first tokens a request would
// find in the engine's reusable KV cache now (and so not compute or
// receive). Safe for concurrent use; the answer can be stale by the time
// the request arrives.
//
// The engine does not reuse blocks yet: the answer is always 0.
func (e *Engine) CachedPrefix(prompt []int32) int {
	return 0
}
