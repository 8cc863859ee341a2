package serve

import (
	"container/list"
	"strconv"
	"sync"

	"github.com/kvxfer/kvxfer/kvcache"
)

// The pure parts of the kv_cache_aware and conversation policies: no I/O,
// no clocks; the router feeds them what it polled and what it sent.

// matchedBlocks is how many of hashes, from the first, are in cached: a
// prefix match stops at the first block missing (the hashes are chained, so
// a later block cannot be reused without the ones before it).
func matchedBlocks(cached map[kvcache.Hash]struct{}, hashes []kvcache.Hash) int {
	for i, h := range hashes {
		if _, ok := cached[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// kvScore is TensorRT-LLM's kv_cache_aware score of a worker: the fraction
// of the prompt's blocks it has cached, less its in-flight requests over
// maxBatch.
func kvScore(matched, blocks int, inflight int64, maxBatch int) float64 {
	return float64(matched)/float64(max(blocks, 1)) - float64(inflight)/float64(max(maxBatch, 1))
}

// kvCandidate is one worker as kv_cache_aware sees it.
type kvCandidate struct {
	matched  int   // prefix blocks it has cached
	inflight int64 // requests in flight
}

// rankKVAware orders candidates best first by kvScore; equal scores keep
// their order rotated by rr, so that ties (and empty caches) spread the
// load as round robin would. It returns the candidates' indices.
func rankKVAware(cands []kvCandidate, blocks, maxBatch int, rr uint64) []int {
	n := len(cands)
	out := make([]int, 0, n)
	if n == 0 {
		return out
	}
	start := int(rr % uint64(n))
	for i := range n {
		out = append(out, (start+i)%n)
	}
	score := make([]float64, n)
	for i, c := range cands {
		score[i] = kvScore(c.matched, blocks, c.inflight, maxBatch)
	}
	// Insertion sort, stable: a handful of workers.
	for i := 1; i < n; i++ {
		for j := i; j > 0 && score[out[j]] > score[out[j-1]]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// sessions is the conversation policy's memory: each conversation's worker
// and its last prompt's prefix hashes, at most max of them and
// maxHashes hashes in all, the least recently used evicted first. A request with a conversation_id continues
// it; one without continues the conversation whose hashes share the
// longest prefix with its own, when that prefix is at least threshold of
// its blocks (TensorRT-LLM's implicit match). Safe for concurrent use.
type sessions struct {
	max       int
	maxHashes int // bounds nhashes (maxSessionHashes)
	threshold float64

	mu     sync.Mutex
	lru    *list.List               // of *session, most recent first
	byID   map[string]*list.Element // conversation id → its element
	byHash map[kvcache.Hash]map[string]struct{}
	next   uint64 // implicit ids
	// nhashes counts the hashes of the conversations remembered.
	nhashes int
}

// maxSessionHashes bounds the prefix hashes the conversation memory keeps
// over all its conversations (about 150 bytes each with their index):
// MaxSessions alone let a client's long prompts (up to MaxPromptTokens
// each, a hash per block) grow the router by gigabytes. Beyond it the
// least recently used conversations are evicted, as beyond MaxSessions;
// the newest is kept however long its prompt.
const maxSessionHashes = 1 << 20

type session struct {
	id     string
	server string
	hashes []kvcache.Hash
}

func newSessions(maxSessions int, threshold float64) *sessions {
	return &sessions{max: max(maxSessions, 1), maxHashes: maxSessionHashes, threshold: threshold, lru: list.New(),
		byID: map[string]*list.Element{}, byHash: map[kvcache.Hash]map[string]struct{}{}}
}

// lookup returns the worker that should serve a request of conversation
// id (empty when the request names none) with prefix hashes, and the
// conversation it continues: id itself, an implicit match, or "" when none
// applies. alive says whether a worker may serve it now.
func (s *sessions) lookup(id string, hashes []kvcache.Hash, alive func(server string) bool) (server, conv string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if id != "" {
		if e, ok := s.byID[id]; ok {
			if ss := e.Value.(*session); alive(ss.server) {
				return ss.server, id
			}
		}
		return "", ""
	}
	// The deepest block shared with some live conversation: the hashes
	// are chained, so equal hashes at depth d mean equal prefixes.
	for d := len(hashes); d > 0; d-- {
		for cid := range s.byHash[hashes[d-1]] {
			ss := s.byID[cid].Value.(*session)
			if !alive(ss.server) {
				continue
			}
			if float64(d)/float64(len(hashes)) >= s.threshold {
				return ss.server, cid
			}
			return "", ""
		}
	}
	return "", ""
}

// record notes that conversation conv (a new implicit one when "") was
// served by server with prefix hashes, and evicts the least recently used
// conversations beyond max. It returns the conversation's id.
func (s *sessions) record(conv, server string, hashes []kvcache.Hash) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if conv == "" {
		s.next++
		conv = "conv_id:" + strconv.FormatUint(s.next, 10)
	}
	if e, ok := s.byID[conv]; ok {
		s.unindex(e.Value.(*session))
		s.lru.Remove(e)
	}
	ss := &session{id: conv, server: server, hashes: hashes}
	s.byID[conv] = s.lru.PushFront(ss)
	s.nhashes += len(hashes)
	for _, h := range hashes {
		m := s.byHash[h]
		if m == nil {
			m = map[string]struct{}{}
			s.byHash[h] = m
		}
		m[conv] = struct{}{}
	}
	for s.lru.Len() > s.max || s.nhashes > s.maxHashes && s.lru.Len() > 1 {
		old := s.lru.Back()
		s.unindex(old.Value.(*session))
		s.lru.Remove(old)
		delete(s.byID, old.Value.(*session).id)
	}
	return conv
}

// forget drops every conversation of server (it left the cluster).
func (s *sessions) forget(server string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for e := s.lru.Front(); e != nil; {
		next := e.Next()
		if ss := e.Value.(*session); ss.server == server {
			s.unindex(ss)
			s.lru.Remove(e)
			delete(s.byID, ss.id)
		}
		e = next
	}
}

// len is the number of conversations remembered.
func (s *sessions) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lru.Len()
}

// unindex drops ss's hashes from the index.
func (s *sessions) unindex(ss *session) {
	s.nhashes -= len(ss.hashes)
	for _, h := range ss.hashes {
		if m := s.byHash[h]; m != nil {
			delete(m, ss.id)
			if len(m) == 0 {
				delete(s.byHash, h)
			}
		}
	}
}

// kvSet is what the router knows of one worker's reusable KV cache: the
// block hashes its events stored and did not remove, and the cursor of its
// event stream. Bounded by maxKVSetBlocks.
type kvSet struct {
	mu     sync.Mutex
	blocks map[kvcache.Hash]struct{}
	after  uint64 // the last event id applied
	epoch  string // the worker's event stream epoch
}

// maxKVSetBlocks bounds one worker's kvSet: blocks stored beyond it are
// not remembered (the worker's pool is smaller than this anyway).
const maxKVSetBlocks = 1 << 20

func newKVSet() *kvSet { return &kvSet{blocks: map[kvcache.Hash]struct{}{}} }

// kvUpdate is one answer of a worker's event route, decoded.
type kvUpdate struct {
	epoch  string
	lost   bool
	next   uint64
	more   bool
	events []kvDelta // in id order
}

// kvDelta is one event's effect.
type kvDelta struct {
	id     uint64
	store  bool
	hashes []kvcache.Hash
}

// apply applies an answer of the worker's event route: a new epoch or lost
// events forget everything first; events at or before the cursor are
// skipped (a repeated answer changes nothing).
func (k *kvSet) apply(u kvUpdate) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if u.lost || (k.epoch != "" && u.epoch != k.epoch) {
		clear(k.blocks)
		if u.epoch != k.epoch {
			k.after = 0
		}
	}
	k.epoch = u.epoch
	for _, d := range u.events {
		if d.id <= k.after {
			continue
		}
		k.after = d.id
		for _, h := range d.hashes {
			if !d.store {
				delete(k.blocks, h)
			} else if len(k.blocks) < maxKVSetBlocks {
				k.blocks[h] = struct{}{}
			}
		}
	}
	k.after = max(k.after, u.next)
}

// matched is matchedBlocks on the set.
func (k *kvSet) matched(hashes []kvcache.Hash) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return matchedBlocks(k.blocks, hashes)
}

// cursor is the last event id applied.
func (k *kvSet) cursor() uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.after
}

// size is the number of blocks known.
func (k *kvSet) size() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.blocks)
}
