package serve

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/kvcache"
)

// The worker's reuse routes, which the router reads for kv_cache_aware and
// conditional disaggregation.
//
// KVEventsPath (TensorRT-LLM's path; GET or POST, as upstream's router
// POSTs) answers the engine's KV cache events as a JSON list in upstream's
// shape: {"event_id": N, "data": {"type": "created",
// "num_blocks_per_cache_level": [n]}}, {"type": "stored", "parent_hash":
// H|null, "blocks": [{"block_hash": H}, ...]} or {"type": "removed",
// "block_hashes": [H, ...]}. The differences from upstream: a hash is
// kvcache's 128-bit chained hash as 32 hex digits (upstream's are 64-bit
// integers), a stored block carries no tokens (upstream's do: they would
// tell anyone who reads the events what other users' prompts contain), and
// there is no hash_algo or window_size.
//
// With ?after=N the answer is the events after id N, and any number of
// readers share the worker, each with its own cursor. Without it the
// answer is the events no cursor-less read has returned yet, as upstream
// drains its event queue. At most ?limit=M (default and most
// MaxKVEventsPerAnswer) events and about MaxKVEventsBytes come back;
// KVEventsMoreHeader says more are waiting. KVEventsNextHeader is the
// cursor to pass next; KVEventsLostHeader (true) says events were dropped
// before the reader could see them (the engine's event_buffer_max_size
// overflowed): the reader forgets what it knew of the worker and rebuilds
// from what follows. KVEventsEpochHeader changes when the worker restarts
// (its event ids start again from 1): a reader whose epoch differs
// forgets as for lost.
//
// CachedPrefixPath answers how many of a prompt's tokens the worker would
// compute now: POST {"prompt_token_ids": [...]} (or "prompt" as text or
// ids, or chat "messages", tokenized as a completion is) →
// {"prompt_tokens": n, "cached_tokens": c, "compute_tokens": n-c}.
//
// Both leak what other users' prompts share with one's own (prefix
// probing): a worker with the cluster secret requires ReuseToken(secret)
// as a bearer token (Authorization: Bearer …, compared in constant time)
// and answers 401 without one, 403 with a wrong one.
const (
	KVEventsPath     = "/kv_cache_events"
	CachedPrefixPath = "/kvxfer/v1/cached_prefix"

	KVEventsNextHeader  = "Kvxfer-Events-Next"
	KVEventsLostHeader  = "Kvxfer-Events-Lost"
	KVEventsMoreHeader  = "Kvxfer-Events-More"
	KVEventsEpochHeader = "Kvxfer-Events-Epoch"

	// MaxKVEventsPerAnswer bounds the events of one answer.
	MaxKVEventsPerAnswer = 1024
	// MaxKVEventsBytes is about the largest answer: events are added while
	// the answer is below it (at least one).
	MaxKVEventsBytes = 4 << 20
)

// ReuseToken is the bearer token of the worker's reuse routes for a
// cluster secret: an HMAC of a fixed label under the secret, hex, so that
// the secret itself never travels. "" for no secret.
func ReuseToken(secret []byte) string {
	if len(secret) == 0 {
		return ""
	}
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("kvxfer worker reuse routes token v1"))
	return hex.EncodeToString(m.Sum(nil))
}

// authorized checks the bearer token of a reuse route's request and
// answers 401 or 403 when it is missing or wrong.
func (w *Worker) authorized(rw http.ResponseWriter, r *http.Request) bool {
	if w.reuseToken == "" {
		return true
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || got == "" {
		rw.Header().Set("WWW-Authenticate", `Bearer realm="kvxfer"`)
		writeError(rw, http.StatusUnauthorized, "unauthorized",
			fmt.Sprintf("%s %s: this worker has a cluster secret: send Authorization: Bearer with the token derived from it (serve.ReuseToken)", r.Method, r.URL.Path))
		return false
	}
	if subtle.ConstantTimeCompare([]byte(got), []byte(w.reuseToken)) != 1 {
		writeError(rw, http.StatusForbidden, "forbidden",
			fmt.Sprintf("%s %s: wrong bearer token (not derived from this cluster's secret)", r.Method, r.URL.Path))
		return false
	}
	return true
}

// kvEventJSON is one event in upstream's shape.
type kvEventJSON struct {
	EventID uint64      `json:"event_id"`
	Data    kvEventData `json:"data"`
}

type kvEventData struct {
	Type        engine.KVEventType `json:"type"`
	NumBlocks   []int              `json:"num_blocks_per_cache_level,omitempty"`
	ParentHash  *string            `json:"parent_hash,omitempty"`
	Blocks      []kvBlockJSON      `json:"blocks,omitempty"`
	BlockHashes []string           `json:"block_hashes,omitempty"`
}

type kvBlockJSON struct {
	BlockHash string `json:"block_hash"`
}

// eventJSON turns an engine event into upstream's shape.
func eventJSON(e engine.KVEvent) kvEventJSON {
	out := kvEventJSON{EventID: e.ID, Data: kvEventData{Type: e.Type}}
	switch e.Type {
	case engine.KVEventCreated:
		out.Data.NumBlocks = []int{e.NumBlocks}
	case engine.KVEventStored:
		if !e.ParentHash.IsRoot() {
			p := e.ParentHash.String()
			out.Data.ParentHash = &p
		}
		out.Data.Blocks = make([]kvBlockJSON, len(e.Hashes))
		for i, h := range e.Hashes {
			out.Data.Blocks[i].BlockHash = h.String()
		}
	case engine.KVEventRemoved:
		out.Data.BlockHashes = make([]string, len(e.Hashes))
		for i, h := range e.Hashes {
			out.Data.BlockHashes[i] = h.String()
		}
	}
	return out
}

// parseHash reads a 32-hex-digit hash.
func parseHash(s string) (kvcache.Hash, error) {
	var h kvcache.Hash
	if len(s) != 2*len(h) {
		return h, fmt.Errorf("block hash %q is not %d hex digits", truncateString(s, 40), 2*len(h))
	}
	if _, err := hex.Decode(h[:], []byte(s)); err != nil {
		return h, fmt.Errorf("block hash %q: %v", truncateString(s, 40), err)
	}
	return h, nil
}

func truncateString(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// newEpoch is a random id of one worker's event stream.
func newEpoch() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// kvEvents serves KVEventsPath.
func (w *Worker) kvEvents(rw http.ResponseWriter, r *http.Request) {
	if !w.authorized(rw, r) {
		return
	}
	q := r.URL.Query()
	limit := MaxKVEventsPerAnswer
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > MaxKVEventsPerAnswer {
			writeError(rw, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("%s: limit %q, want 1..%d", KVEventsPath, s, MaxKVEventsPerAnswer))
			return
		}
		limit = n
	}
	var page kvEventsPage
	if !q.Has("after") {
		page = w.drainKVEvents(limit)
	} else {
		after, err := strconv.ParseUint(q.Get("after"), 10, 64)
		if err != nil {
			writeError(rw, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("%s: after %q is not an event id", KVEventsPath, q.Get("after")))
			return
		}
		page = w.readKVEvents(after, limit)
	}
	out, next, lost, more := page.events, page.next, page.lost, page.more
	h := rw.Header()
	h.Set("Content-Type", "application/json")
	h.Set(KVEventsNextHeader, strconv.FormatUint(next, 10))
	h.Set(KVEventsEpochHeader, w.epoch)
	if lost {
		h.Set(KVEventsLostHeader, "true")
	}
	if more {
		h.Set(KVEventsMoreHeader, "true")
	}
	json.NewEncoder(rw).Encode(out)
}

// kvEventsPage is one answer of KVEventsPath: its events, the cursor
// after them, and whether events were lost before them or more follow.
type kvEventsPage struct {
	events     []kvEventJSON
	next       uint64
	lost, more bool
}

// readKVEvents returns the events after the id after, at most limit of
// them and about MaxKVEventsBytes.
func (w *Worker) readKVEvents(after uint64, limit int) kvEventsPage {
	src := w.eng.KVEvents
	if w.kvEventsSource != nil {
		src = w.kvEventsSource
	}
	events, lost := src(after)
	p := kvEventsPage{events: make([]kvEventJSON, 0, min(len(events), limit)), next: after, lost: lost}
	size := 2
	for i, e := range events {
		if i == limit || (i > 0 && size > MaxKVEventsBytes) {
			p.more = true
			break
		}
		size += 64 + 40*(len(e.Hashes)) // about its JSON length
		p.events = append(p.events, eventJSON(e))
		p.next = e.ID
	}
	return p
}

// drainKVEvents is readKVEvents after the shared cursor of cursor-less
// readers, which it advances past what it returns. The lock covers the
// cursor only, never the answer's writing: a reader whose client does not
// read holds up no other.
func (w *Worker) drainKVEvents(limit int) kvEventsPage {
	w.drainMu.Lock()
	defer w.drainMu.Unlock()
	p := w.readKVEvents(w.drainAfter, limit)
	w.drainAfter = p.next
	return p
}

// CachedPrefix is CachedPrefixPath's answer.
type CachedPrefix struct {
	PromptTokens  int `json:"prompt_tokens"`
	CachedTokens  int `json:"cached_tokens"`
	ComputeTokens int `json:"compute_tokens"`
}

// cachedPrefix serves CachedPrefixPath.
func (w *Worker) cachedPrefix(rw http.ResponseWriter, r *http.Request) {
	if !w.authorized(rw, r) {
		return
	}
	body, herr := readBody(r)
	if herr != nil {
		writeError(rw, herr.code, herr.typ, CachedPrefixPath+": "+herr.msg)
		return
	}
	var cr completionRequest
	if err := json.Unmarshal(body, &cr); err != nil {
		writeError(rw, http.StatusBadRequest, "invalid_request_error", CachedPrefixPath+": request body: "+err.Error())
		return
	}
	prompt, herr := requestPrompt(w.tok, &cr, len(cr.Messages) > 0)
	if herr != nil {
		writeError(rw, herr.code, herr.typ, CachedPrefixPath+": "+herr.msg)
		return
	}
	if len(cr.CacheSalt) > MaxCacheSaltLen {
		writeError(rw, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("%s: cache_salt has %d bytes, at most %d", CachedPrefixPath, len(cr.CacheSalt), MaxCacheSaltLen))
		return
	}
	c := w.shown(min(max(w.eng.CachedPrefixSalted(prompt, cr.CacheSalt), 0), len(prompt)))
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(CachedPrefix{PromptTokens: len(prompt), CachedTokens: c, ComputeTokens: len(prompt) - c})
}

// engineReuseOptions sets opts' block reuse from the worker file's
// kv_cache_config: enable_block_reuse, enable_partial_reuse and
// copy_on_partial_reuse (each true unless the file says false, as
// upstream), and event_buffer_max_size (0: the engine keeps no events, and
// /kv_cache_events answers none).
func engineReuseOptions(wc *config.Worker, opts engine.Options) engine.Options {
	opts.BlockReuse, opts.PartialReuse, opts.CopyOnPartialReuse = wc.KVCache.Reuse()
	opts.EventBufferMaxSize = wc.KVCache.EventBufferMaxSize
	return opts
}
