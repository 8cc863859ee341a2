package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strconv"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
)

// The router's side of reuse: the routing information of one request
// (its prompt's token ids and block hashes, its conversation), the poller
// of the workers' KV cache events (kv_cache_aware), and conditional
// disaggregation.

// RouteHeader on the router's answer says which path a request took:
// RouteLocal (prefilled on the generation worker, no context worker, no
// KV moved) or RouteDisaggregated (through a context worker).
const (
	RouteHeader        = "X-Kvxfer-Route"
	RouteLocal         = "local"
	RouteDisaggregated = "disaggregated"
)

// DefaultKVEventsInterval is RouterOptions.KVEventsInterval's default.
const DefaultKVEventsInterval = 100 * time.Millisecond

// maxKVEventsAnswer bounds the body of a worker's event answer the router
// reads (the worker keeps to about MaxKVEventsBytes): a larger one is an
// error, and nothing of it is applied.
const maxKVEventsAnswer = 4 * MaxKVEventsBytes

// maxKVEventPages bounds the answers read from one worker in one poll.
const maxKVEventPages = 8

// routeInfo is what the policies read of one request.
type routeInfo struct {
	prompt []int32 // as the worker tokenizes it; nil when it cannot be read (the worker will say why)
	conv   string  // conversation_id, "" for none
	salt   string  // cache_salt, "" for none
	hashes map[int][]kvcache.Hash
	only   *upstream // when set, the request goes to this server only
}

// blockHashes returns the chained hashes of the prompt's full blocks of
// tokensPerBlock tokens, after skip tokens. A salted request's chain
// starts from its salt's root (kvcache.RootHash), as the engine's does.
func (ri *routeInfo) blockHashes(tokensPerBlock, skip int) []kvcache.Hash {
	if ri == nil || len(ri.prompt) <= skip || tokensPerBlock <= 0 {
		return nil
	}
	k := tokensPerBlock<<20 | skip
	if h, ok := ri.hashes[k]; ok {
		return h
	}
	h := kvcache.HashBlocks(kvcache.RootHash(ri.salt), ri.prompt[skip:], tokensPerBlock)
	if ri.hashes == nil {
		ri.hashes = map[int][]kvcache.Hash{}
	}
	ri.hashes[k] = h
	return h
}

// newRouteInfo reads the routing information of a client's request when a
// policy needs it.
func (r *Router) newRouteInfo(path string, orig object) *routeInfo {
	ri := &routeInfo{}
	if raw, ok := orig["conversation_id"]; ok {
		var s string
		if json.Unmarshal(raw, &s) != nil {
			s = string(raw) // a number: its text
		}
		ri.conv = s
	}
	if raw, ok := orig["cache_salt"]; ok {
		json.Unmarshal(raw, &ri.salt) // a bad one: the worker refuses the request, saying why
	}
	if !r.needPrompt {
		return ri
	}
	// The fields requestPrompt reads; a bad one leaves the prompt unknown
	// (the worker will refuse the request, saying why).
	var cr completionRequest
	cr.Prompt = orig["prompt"]
	if _, err := orig.get("prompt_token_ids", &cr.PromptTokenIDs); err != nil {
		return ri
	}
	if _, err := orig.get("messages", &cr.Messages); err != nil {
		return ri
	}
	ri.prompt, _ = requestPrompt(r.tok, &cr, path == "/v1/chat/completions")
	return ri
}

// MaxConversationIDLen bounds a request's conversation_id, in bytes of
// its JSON: the conversation policy remembers up to MaxSessions of them.
const MaxConversationIDLen = 1024

// takeConversation moves a conversation id out of a client's
// disaggregated_params (TensorRT-LLM's place for it) to conversation_id;
// any other disaggregated_params field is refused, and so is a
// conversation_id over MaxConversationIDLen.
func takeConversation(orig object) error {
	if raw, ok := orig["disaggregated_params"]; ok {
		var dp map[string]json.RawMessage
		if err := json.Unmarshal(raw, &dp); err != nil || len(dp) != 1 || dp["conversation_id"] == nil {
			return errors.New("disaggregated_params is set by the router; send the plain OpenAI request (only disaggregated_params.conversation_id may be set, for the conversation router)")
		}
		orig["conversation_id"] = dp["conversation_id"]
		delete(orig, "disaggregated_params")
	}
	if n := len(orig["conversation_id"]); n > MaxConversationIDLen {
		return fmt.Errorf("conversation_id has %d bytes of JSON, at most %d", n, MaxConversationIDLen)
	}
	return nil
}

// orderKVAware is kv_cache_aware's order of servers for ri.
func (g *group) orderKVAware(servers []*upstream, ri *routeInfo) []*upstream {
	hashes := ri.blockHashes(g.tokensPerBlock, 0)
	cands := make([]kvCandidate, len(servers))
	for i, s := range servers {
		cands[i] = kvCandidate{matched: s.kv.matched(hashes), inflight: s.inflight.Load()}
	}
	idx := rankKVAware(cands, len(hashes), g.args.MaxBatchSize, g.next.Add(1))
	out := make([]*upstream, len(idx))
	for i, j := range idx {
		out[i] = servers[j]
	}
	return out
}

// orderConversation is the conversation policy's order for ri: the
// conversation's worker first when it has one that is up, then the rest
// by load. It returns the conversation ri continues ("" for none).
func (g *group) orderConversation(servers []*upstream, ri *routeInfo) ([]*upstream, string) {
	rest := g.orderLoad(servers)
	byURL := map[string]*upstream{}
	for _, s := range servers {
		if !s.down.Load() {
			byURL[s.url] = s
		}
	}
	var conv string
	var hashes []kvcache.Hash
	id := ""
	if ri != nil {
		hashes, id = ri.blockHashes(g.args.TokensPerBlock, g.args.HashSkipCount), ri.conv
	}
	url, conv := g.conv.lookup(id, hashes, func(u string) bool { return byURL[u] != nil })
	if s := byURL[url]; s != nil {
		out := []*upstream{s}
		for _, o := range rest {
			if o != s {
				out = append(out, o)
			}
		}
		return out, conv
	}
	return rest, conv
}

// served records, for the conversation policy, that ri went to s.
func (g *group) served(ri *routeInfo, conv string, s *upstream) {
	if g.policy != Conversation || s == nil {
		return
	}
	var hashes []kvcache.Hash
	if ri != nil {
		if conv == "" {
			conv = ri.conv
		}
		hashes = ri.blockHashes(g.args.TokensPerBlock, g.args.HashSkipCount)
	}
	g.conv.record(conv, s.url, hashes)
}

// startKVPoller starts, once, the goroutine that polls the KV cache events
// of the workers of kv_cache_aware groups; Close stops it. It runs from
// the first routed request on (NewRouter starts no goroutine for it).
func (r *Router) startKVPoller() {
	if !r.kvPolled {
		return
	}
	r.kvOnce.Do(func() {
		r.probes.Add(1)
		go func() {
			defer r.probes.Done()
			t := time.NewTicker(r.kvInterval)
			defer t.Stop()
			for {
				r.pollKV()
				select {
				case <-r.life.Done():
					return
				case <-t.C:
				case <-r.kvNudge:
				}
			}
		}()
	})
}

// nudgeKV asks the poller for a round now (a request ended: its blocks
// may be stored), as TensorRT-LLM's router polls when a request finishes.
func (r *Router) nudgeKV() {
	if !r.kvPolled {
		return
	}
	select {
	case r.kvNudge <- struct{}{}:
	default:
	}
}

// pollKV starts a poll of each worker of the kv_cache_aware groups that is
// not being polled already: a slow worker holds up only its own polls.
func (r *Router) pollKV() {
	for _, g := range []*group{r.prefill, r.gen} {
		if g.policy != KVCacheAware {
			continue
		}
		for _, s := range g.list() {
			if s.removed.Load() || !s.polling.CompareAndSwap(false, true) {
				continue
			}
			r.probes.Add(1)
			go func() {
				defer r.probes.Done()
				defer s.polling.Store(false)
				err := r.pollWorker(r.life, s)
				switch {
				case err == nil:
					r.m.Upstream.WithLabelValues(g.name, "kv_events").Inc()
				case r.life.Err() == nil:
					r.m.Upstream.WithLabelValues(g.name, "kv_events_error").Inc()
					r.warn("kv-events:"+s.url, "cannot read a worker's KV cache events: its cached blocks are not updated", "role", g.name, "url", s.url, "err", err)
				}
			}()
		}
	}
}

// pollWorker reads s's new KV cache events (at most maxKVEventPages
// answers) and applies them to s.kv.
func (r *Router) pollWorker(ctx context.Context, s *upstream) error {
	for range maxKVEventPages {
		u, err := r.readKVEvents(ctx, s.url, s.kv.cursor())
		if err != nil {
			return err
		}
		s.kv.apply(u)
		if !u.more {
			return nil
		}
	}
	return nil
}

// readKVEvents asks the worker at base for its events after cursor, within
// HealthTimeout.
func (r *Router) readKVEvents(ctx context.Context, base string, after uint64) (kvUpdate, error) {
	ctx, cancel := context.WithTimeout(ctx, r.d.HealthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+KVEventsPath+"?after="+strconv.FormatUint(after, 10), nil)
	if err != nil {
		return kvUpdate{}, err
	}
	r.authorize(req)
	resp, err := r.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return kvUpdate{}, fmt.Errorf("no answer within %v", r.d.HealthTimeout)
		}
		return kvUpdate{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxKVEventsAnswer+1))
	if err != nil {
		if ctx.Err() != nil {
			return kvUpdate{}, fmt.Errorf("answer not read within %v", r.d.HealthTimeout)
		}
		return kvUpdate{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return kvUpdate{}, fmt.Errorf("%s: %s", resp.Status, truncateString(string(bytes.TrimSpace(body)), 200))
	}
	if len(body) > maxKVEventsAnswer {
		return kvUpdate{}, fmt.Errorf("answer larger than %d bytes", maxKVEventsAnswer)
	}
	return decodeKVEvents(resp.Header, body, after)
}

// errKVEvents: a worker's event answer cannot be used.
var errKVEvents = errors.New("serve: bad KV cache events answer")

// decodeKVEvents decodes a worker's answer to ?after=after. The events must
// come in increasing id order after after; stored and removed events must
// carry valid hashes. Nothing of a bad answer is applied.
func decodeKVEvents(h http.Header, body []byte, after uint64) (kvUpdate, error) {
	u := kvUpdate{epoch: h.Get(KVEventsEpochHeader), lost: h.Get(KVEventsLostHeader) == "true", more: h.Get(KVEventsMoreHeader) == "true"}
	var evs []kvEventJSON
	if err := json.Unmarshal(body, &evs); err != nil {
		return kvUpdate{}, fmt.Errorf("%w: %v", errKVEvents, err)
	}
	last := after
	for i, e := range evs {
		if e.EventID <= last {
			return kvUpdate{}, fmt.Errorf("%w: event %d has id %d, not after %d", errKVEvents, i, e.EventID, last)
		}
		last = e.EventID
		d := kvDelta{id: e.EventID}
		var hs []string
		switch e.Data.Type {
		case "stored":
			d.store = true
			for _, b := range e.Data.Blocks {
				hs = append(hs, b.BlockHash)
			}
		case "removed":
			hs = e.Data.BlockHashes
		}
		for _, s := range hs {
			hash, err := parseHash(s)
			if err != nil {
				return kvUpdate{}, fmt.Errorf("%w: event %d: %v", errKVEvents, e.EventID, err)
			}
			d.hashes = append(d.hashes, hash)
		}
		u.events = append(u.events, d)
	}
	u.next = last
	if s := h.Get(KVEventsNextHeader); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil || n < last {
			return kvUpdate{}, fmt.Errorf("%w: %s %q, want an event id at or after %d", errKVEvents, KVEventsNextHeader, s, last)
		}
		u.next = n
	}
	return u, nil
}

// authorize adds the reuse routes' bearer token, when the cluster has a
// secret.
func (r *Router) authorize(req *http.Request) {
	if r.reuseToken != "" {
		req.Header.Set("Authorization", "Bearer "+r.reuseToken)
	}
}

// askCachedPrefix asks the worker at base how many of prompt's tokens it
// has cached, within HealthTimeout.
func (r *Router) askCachedPrefix(ctx context.Context, base string, prompt []int32, salt string) (CachedPrefix, error) {
	ctx, cancel := context.WithTimeout(ctx, r.d.HealthTimeout)
	defer cancel()
	q := map[string]any{"prompt_token_ids": prompt}
	if salt != "" {
		q["cache_salt"] = salt
	}
	b, _ := json.Marshal(q)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+CachedPrefixPath, bytes.NewReader(b))
	if err != nil {
		return CachedPrefix{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	r.authorize(req)
	resp, err := r.client.Do(req)
	if err != nil {
		return CachedPrefix{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return CachedPrefix{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return CachedPrefix{}, fmt.Errorf("%s: %s", resp.Status, truncateString(string(bytes.TrimSpace(body)), 200))
	}
	var cp CachedPrefix
	if err := json.Unmarshal(body, &cp); err != nil {
		return CachedPrefix{}, fmt.Errorf("answer: %v", err)
	}
	if cp.PromptTokens != len(prompt) || cp.CachedTokens < 0 || cp.CachedTokens > cp.PromptTokens {
		return CachedPrefix{}, fmt.Errorf("answer %+v does not fit a prompt of %d tokens", cp, len(prompt))
	}
	return cp, nil
}

// localPrefill reports whether conditional disaggregation prefills a
// prompt on the generation worker itself: TensorRT-LLM's rule, some of it
// cached and at most maxLocal tokens left to compute.
func localPrefill(cp CachedPrefix, maxLocal int) bool {
	return cp.CachedTokens > 0 && cp.PromptTokens-cp.CachedTokens <= maxLocal
}

// tryLocal runs conditional disaggregation: it picks the generation worker
// first, asks it how much of the prompt it would compute and, when
// localPrefill says so, sends it the request as context_and_generation and
// relays its answer. It reports whether it answered w; when not, the
// request takes the disaggregated path.
func (r *Router) tryLocal(w http.ResponseWriter, req *http.Request, path string, orig object, ri *routeInfo) bool {
	if r.cond == nil || ri.prompt == nil {
		return false
	}
	order, _ := r.gen.orderFor(ri)
	if len(order) == 0 || order[0].down.Load() {
		return false
	}
	s := order[0]
	ctx := req.Context()
	cp, err := r.askCachedPrefix(ctx, s.url, ri.prompt, ri.salt)
	if err != nil {
		r.warn("cached-prefix:"+s.url, "cannot ask a generation worker what it has cached: the request goes through a context worker",
			"url", s.url, "err", err)
		return false
	}
	if !localPrefill(cp, r.cond.MaxLocalPrefillLength) {
		return false
	}
	body := maps.Clone(orig)
	body.set("disaggregated_params", DisaggregatedParams{RequestType: TypeContextAndGeneration})
	ri.only = s
	resp, srv, err := r.post(ctx, r.gen, path, body, nil, ri)
	ri.only = nil
	if err != nil && srv == nil {
		return false // unreachable: nothing was sent
	}
	r.paths.WithLabelValues(RouteLocal).Inc()
	w.Header().Set(RouteHeader, RouteLocal)
	r.log.Debug("conditional disaggregation: prefilled on the generation worker", "url", s.url,
		"prompt_tokens", cp.PromptTokens, "cached_tokens", cp.CachedTokens, "max_local_prefill_length", r.cond.MaxLocalPrefillLength)
	relay(w, resp, err, streamCopy)
	return true
}

// ClusterRouting returns the routing part of a cluster file as
// RouterOptions: each group's urls, policy and router arguments, the
// workers' tokens_per_block (kv_cache_aware hashes with it), and
// conditional_disagg_config. The caller adds the rest (logger, TLS,
// deadlines, membership, secret).
func ClusterRouting(cl *config.Cluster) RouterOptions {
	return RouterOptions{Context: cl.Context.URLs, Generation: cl.Generation.URLs,
		ContextPolicy: Policy(cl.Context.Router), GenerationPolicy: Policy(cl.Generation.Router),
		ContextArgs: cl.Context.RouterArgs, GenerationArgs: cl.Generation.RouterArgs,
		ContextTokensPerBlock: cl.Context.KVCache.TokensPerBlock, GenerationTokensPerBlock: cl.Generation.KVCache.TokensPerBlock,
		ConditionalDisagg: cl.ConditionalDisagg}
}
