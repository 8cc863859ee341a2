package serve

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/prometheus/client_golang/prometheus"
)

// Worker roles.
const (
	RoleContext    = "context"
	RoleGeneration = "generation"
	RoleBoth       = "both"
)

// DefaultModel is the engine preset a worker serves when its command line
// names none (kvxfer serve, kvxfer up).
const DefaultModel = "tiny-gqa"

// WorkerOptions configure a Worker.
type WorkerOptions struct {
	// Role is context (serves context_only), generation (generation_only,
	// and context_and_generation when the request says so: the router's
	// conditional disaggregation) or both (every request type; the
	// disaggregated ones need a transceiver).
	Role string
	// Model is an engine preset name (engine.Presets).
	Model string
	// Config is the worker file (TP, PP, kv_cache_config,
	// cache_transceiver_config).
	Config *config.Worker
	// DType is the KV cache dtype; zero means bf16.
	DType engine.DType
	// TransceiverHost is the address the transceiver listens on (its
	// control and data planes); "" means 127.0.0.1.
	TransceiverHost string
	// Secret is the cluster secret: with it the transceiver signs the
	// opaque states it hands out and refuses unsigned, forged, expired and
	// replayed ones, and the reuse routes (KVEventsPath, CachedPrefixPath)
	// require ReuseToken(Secret); nil runs unauthenticated (see
	// transceiver.Options).
	Secret []byte
	// AllowedPeerHosts are the hosts the transceiver may dial and accept
	// transfer connections from, beyond loopback (security.allowed_peer_hosts
	// and TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS).
	AllowedPeerHosts []string
	Logger           *slog.Logger
	// TLS, when non-nil, makes the transceiver's control connections and
	// tcp data plane mutual TLS (shm and ucx are not covered). The HTTP
	// listener is the caller's: kvxfer serve wraps it with TLS.Server.
	TLS *tlsconf.Config
	// WrapDataPlane wraps the transceiver's data planes (fault injection:
	// kvxfer built with -tags chaos; see transceiver.Options).
	WrapDataPlane func(name string, t transport.Transport) transport.Transport
}

// Worker is an OpenAI-compatible HTTP worker around one engine instance.
type Worker struct {
	role    string
	model   string
	eng     *engine.Engine
	tr      *transceiver.Transceiver
	tok     engine.Tokenizer
	log     *slog.Logger
	reg     *prometheus.Registry
	m       *metrics.Set
	created int64
	seq     atomic.Uint64
	// draftOnce logs once that draft_tokens are accepted but not used.
	draftOnce sync.Once

	// The reuse routes (kvevents.go): the bearer token they require ("" for
	// none), this event stream's epoch, and the cursor of cursor-less
	// readers.
	reuseToken string
	epoch      string
	drainMu    sync.Mutex
	drainAfter uint64
	// kvEventsSource, when set (by tests), replaces the engine's KVEvents.
	kvEventsSource func(after uint64) ([]engine.KVEvent, bool)
	// promptTokens and cachedTokens count prompt tokens served and those
	// found in the worker's reusable cache (whole blocks: see shown).
	promptTokens, cachedTokens prometheus.Counter
	// tpb is the tokens per KV block.
	tpb int
}

// NewWorker builds the model, its sharded instance, the transceiver (when
// the worker file has a cache_transceiver_config: the one place the public
// config becomes transport options is transceiver.New) and the engine. It
// starts no goroutines; the engine starts on the first request.
func NewWorker(ctx context.Context, o WorkerOptions) (*Worker, error) {
	switch o.Role {
	case RoleContext, RoleGeneration, RoleBoth:
	default:
		return nil, fmt.Errorf("serve: role %q (valid: context, generation, both)", o.Role)
	}
	wc := o.Config
	if wc == nil {
		wc = config.DefaultWorker()
	}
	if o.Role != RoleBoth && (wc.CacheTransceiver == nil || wc.CacheTransceiver.Backend == config.BackendUnset) {
		return nil, fmt.Errorf("serve: a %s worker needs a cache_transceiver_config with a backend (e.g. backend: DEFAULT)", o.Role)
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	mc, err := engine.Preset(o.Model)
	if err != nil {
		return nil, err
	}
	model, err := engine.NewModel(mc)
	if err != nil {
		return nil, err
	}
	inst, err := engine.NewInstance(model, engine.InstanceConfig{TP: wc.TensorParallelSize, PP: wc.PipelineParallelSize,
		TokensPerBlock: wc.KVCache.TokensPerBlock, DType: o.DType, PoolTokens: wc.KVCache.MaxTokens,
		Allocator: transceiver.PoolAllocator(wc.CacheTransceiver)})
	if err != nil {
		return nil, err
	}
	w := &Worker{role: o.Role, model: o.Model, log: log, reg: metrics.NewRegistry(), created: time.Now().Unix(),
		reuseToken: ReuseToken(o.Secret), epoch: newEpoch(), tpb: wc.KVCache.TokensPerBlock}
	w.m = metrics.New(w.reg)
	w.promptTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvxfer_prefix_cache_prompt_tokens_total",
		Help: "Prompt tokens of the requests the worker served."})
	w.cachedTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvxfer_prefix_cache_hit_tokens_total",
		Help: "Prompt tokens whose KV the worker found in its own reusable cache (neither computed nor received)."})
	w.reg.MustRegister(w.promptTokens, w.cachedTokens)
	var tr *transceiver.Transceiver
	if ct := wc.CacheTransceiver; ct != nil && ct.Backend != config.BackendUnset {
		tr, err = transceiver.New(ctx, ct, transceiver.Options{State: inst.State(), Pools: inst.Pools(),
			ListenHost: o.TransceiverHost, Logger: log, Observer: observer{w.m},
			Secret: o.Secret, AllowedPeerHosts: o.AllowedPeerHosts, TLS: o.TLS.Transport(), WrapDataPlane: o.WrapDataPlane})
		if err != nil {
			inst.Close()
			return nil, err
		}
		res := tr.Resolution()
		log.Info("transceiver ready", "backend", string(res.Backend), "reason", res.Reason, "endpoints", tr.Endpoints())
		if res.Warning != "" {
			// The same warning kvxfer config check prints for this file.
			log.Warn(res.Warning, "configured", string(res.Configured), "backend", string(res.Backend))
		}
		w.m.AddTransceiver(tr.StagingBytesInUse, tr.ControlConnections)
	}
	for i, p := range inst.Pools() {
		w.m.AddPool(i, func() metrics.PoolStats {
			s := p.Stats()
			return metrics.PoolStats{Free: s.Free, Cached: s.Cached, Pinned: s.Pinned}
		})
	}
	eng, err := engine.New(inst, engineReuseOptions(wc, engine.Options{Transceiver: tr, Logger: log}))
	if err != nil {
		if tr != nil {
			tr.Close()
		}
		inst.Close()
		return nil, err
	}
	w.eng, w.tr = eng, tr
	return w, nil
}

// observer feeds transfer events to the metrics.
type observer struct{ m *metrics.Set }

func (o observer) TransferStarted(role string) { o.m.InFlight.WithLabelValues(role).Inc() }

func (o observer) TransferEnded(r transceiver.Record) {
	o.m.InFlight.WithLabelValues(r.Role).Dec()
	o.m.Transfers.WithLabelValues(r.Role, r.Result).Inc()
	if r.Bytes > 0 {
		o.m.TransferBytes.WithLabelValues(r.Backend, r.Role).Add(float64(r.Bytes))
		o.m.TransferDuration.WithLabelValues(r.Role).Observe(r.Duration.Seconds())
	}
	o.m.TransferDelay.WithLabelValues(r.Role).Observe(r.Delay.Seconds())
}

// Close stops the engine (failing requests in flight) and the transceiver.
func (w *Worker) Close() error { return w.eng.Close() }

// Engine returns the worker's engine.
func (w *Worker) Engine() *engine.Engine { return w.eng }

// Registry returns the worker's metrics registry.
func (w *Worker) Registry() *prometheus.Registry { return w.reg }

// shown is how many of n cached prompt tokens the worker tells anyone
// outside: whole blocks only. With partial reuse the engine also reuses
// the matching first tokens of the next cached block; a count exact to
// the token would let a client that knows how another user's prompt
// begins read what follows it one token at a time (guess a token, see
// whether the count grows), where whole blocks leave it a whole block to
// guess at once.
func (w *Worker) shown(n int) int {
	if w.tpb <= 0 {
		return n
	}
	return n / w.tpb * w.tpb
}

// Handler returns the worker's HTTP handler.
func (w *Worker) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(rw http.ResponseWriter, r *http.Request) { w.complete(rw, r, false) })
	mux.HandleFunc("POST /v1/chat/completions", func(rw http.ResponseWriter, r *http.Request) { w.complete(rw, r, true) })
	mux.HandleFunc("GET /v1/models", w.models)
	mux.HandleFunc("GET /health", func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		st := w.eng.Stats()
		json.NewEncoder(rw).Encode(map[string]any{"status": "ok", "role": w.role, "model": w.model,
			"waiting": st.Waiting, "running": st.Running, "transferring": st.Transferring,
			"free_blocks": w.eng.Instance().FreeBlocks(), "total_blocks": w.eng.Instance().NumBlocks()})
	})
	mux.HandleFunc("POST "+CancelContextPath, w.cancelContext)
	mux.HandleFunc("GET "+KVEventsPath, w.kvEvents)
	mux.HandleFunc("POST "+KVEventsPath, w.kvEvents)
	mux.HandleFunc("POST "+CachedPrefixPath, w.cachedPrefix)
	mux.Handle("GET /metrics", metrics.Handler(w.reg))
	mux.HandleFunc("/", func(rw http.ResponseWriter, r *http.Request) {
		writeError(rw, http.StatusNotFound, "not_found", fmt.Sprintf("no route %s %s", r.Method, r.URL.Path))
	})
	return countCodes(mux, w.m.HTTPRequests)
}

// CancelContextPath is the worker's route that releases a context request
// it holds for a generation worker that will not come (the router calls it
// when the generation phase is refused or fails before the pull, or when
// its client goes away). The body is the context phase's
// disaggregated_params, or at least their ctx_request_id and
// encoded_opaque_state: the state is the proof of ownership. It carries a
// random transfer token, so only whoever received the context phase's
// answer holds it, and that one could pull the request anyway; cancelling
// gives it no power it did not have. The route is behind the worker's
// mutual TLS like every other one. 200 {"cancelled": true} when a held
// request was released; 404 when no held request has this id and state
// (unknown, already pulled, expired, already cancelled, or a wrong state:
// the answers are the same, so that ids cannot be probed).
const CancelContextPath = "/v1/disaggregated/cancel"

func (w *Worker) cancelContext(rw http.ResponseWriter, r *http.Request) {
	body, herr := readBody(r)
	if herr != nil {
		writeError(rw, herr.code, herr.typ, herr.msg)
		return
	}
	var dp DisaggregatedParams
	if err := json.Unmarshal(body, &dp); err != nil {
		writeError(rw, http.StatusBadRequest, "invalid_request_error", "request body: "+err.Error())
		return
	}
	if dp.CtxRequestID == nil || dp.EncodedOpaqueState == "" {
		writeError(rw, http.StatusBadRequest, "invalid_request_error", "ctx_request_id and encoded_opaque_state are required")
		return
	}
	opaque, err := base64.StdEncoding.DecodeString(dp.EncodedOpaqueState)
	if err != nil {
		writeError(rw, http.StatusBadRequest, "invalid_request_error", "encoded_opaque_state is not base64: "+err.Error())
		return
	}
	if w.tr == nil || !w.eng.CancelContextState(*dp.CtxRequestID, opaque) {
		writeError(rw, http.StatusNotFound, "not_found", fmt.Sprintf("no held context request %d with this opaque state (pulled, expired, cancelled or never issued)", *dp.CtxRequestID))
		return
	}
	w.log.Debug("context request cancelled", "ctx_request", *dp.CtxRequestID, "from", r.RemoteAddr)
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(map[string]any{"cancelled": true, "ctx_request_id": *dp.CtxRequestID})
}

func (w *Worker) models(rw http.ResponseWriter, _ *http.Request) {
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(map[string]any{"object": "list", "data": []map[string]any{
		{"id": w.model, "object": "model", "created": w.created, "owned_by": "kvxfer"}}})
}

// completionRequest is the part of an OpenAI completion or chat request the
// worker reads. Other fields are accepted and ignored.
type completionRequest struct {
	Model          string          `json:"model"`
	Prompt         json.RawMessage `json:"prompt"`
	Messages       []chatMessage   `json:"messages"`
	PromptTokenIDs []int32         `json:"prompt_token_ids"`
	MaxTokens      *int            `json:"max_tokens"`
	MaxCompletion  *int            `json:"max_completion_tokens"`
	Temperature    *float64        `json:"temperature"`
	Seed           *uint64         `json:"seed"`
	Stop           json.RawMessage `json:"stop"`
	Stream         bool            `json:"stream"`
	StreamOptions  *streamOptions  `json:"stream_options"`
	N              *int            `json:"n"`
	IgnoreEOS      bool            `json:"ignore_eos"`
	// ReturnTokenIDs adds the generated token ids to each choice (and to
	// each stream chunk: the ids whose text the chunk completes), and the
	// prompt's ids to the answer, as vLLM's return_token_ids does.
	ReturnTokenIDs bool                 `json:"return_token_ids"`
	Disagg         *DisaggregatedParams `json:"disaggregated_params"`
	// ResumeTokenIDs (kvxfer's extension, ResumeField) continue the
	// request after these generated tokens (engine.Request.Resume): the
	// router sets them when it migrates a request off a generation worker
	// that died mid-stream. The answer carries what follows them; usage
	// counts them.
	ResumeTokenIDs []int32 `json:"kvxfer_resume_token_ids"`
	// CacheSalt (vLLM's cache_salt) keeps the request's cached prefix
	// apart from every request with another salt: blocks are reused only
	// between requests with the same salt (engine.Request.CacheSalt), so a
	// tenant can keep others from probing what it has cached.
	CacheSalt string `json:"cache_salt"`
}

// MaxCacheSaltLen bounds cache_salt, in bytes.
const MaxCacheSaltLen = 1024

// ResumeField is the request field that carries the resumed tokens of a
// migrated request (completionRequest.ResumeTokenIDs). The router sets it;
// a client's request to the router may not.
const ResumeField = "kvxfer_resume_token_ids"

// MaxResumeTokens bounds ResumeField: fewer than the most max_tokens.
const MaxResumeTokens = 1 << 16

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// MaxPromptTokens bounds a prompt (bytes are tokens here).
const MaxPromptTokens = 1 << 20

// httpError is an error with the HTTP status it maps to.
type httpError struct {
	code int
	typ  string
	msg  string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, args ...any) *httpError {
	return &httpError{http.StatusBadRequest, "invalid_request_error", fmt.Sprintf(format, args...)}
}

// parse turns the body into an engine request, checking everything a
// client can get wrong.
func (w *Worker) parse(body []byte, chat bool) (*completionRequest, engine.Request, *httpError) {
	var cr completionRequest
	// Unmarshal, not a Decoder: it refuses what follows the object, as
	// the router does.
	if err := json.Unmarshal(body, &cr); err != nil {
		return nil, engine.Request{}, badRequest("request body: %v", err)
	}
	var er engine.Request
	if cr.Model != "" && cr.Model != w.model {
		return nil, er, &httpError{http.StatusNotFound, "model_not_found", fmt.Sprintf("model %q is not served here (this worker serves %q)", cr.Model, w.model)}
	}
	if cr.N != nil && *cr.N != 1 {
		return nil, er, badRequest("n = %d: kvxfer serves one choice per request", *cr.N)
	}
	if herr := w.parseRequestPrompt(&cr, chat, &er); herr != nil {
		return nil, er, herr
	}
	if herr := parseSampling(&cr, &er); herr != nil {
		return nil, er, herr
	}
	if len(cr.ResumeTokenIDs) >= MaxResumeTokens {
		return nil, er, badRequest("%s has %d tokens, at most %d", ResumeField, len(cr.ResumeTokenIDs), MaxResumeTokens-1)
	}
	er.Resume = cr.ResumeTokenIDs
	if len(cr.CacheSalt) > MaxCacheSaltLen {
		return nil, er, badRequest("cache_salt has %d bytes, at most %d", len(cr.CacheSalt), MaxCacheSaltLen)
	}
	er.CacheSalt = cr.CacheSalt
	if herr := w.parseDisagg(&cr, &er); herr != nil {
		return nil, er, herr
	}
	return &cr, er, nil
}

// parseRequestPrompt sets er's prompt (requestPrompt).
func (w *Worker) parseRequestPrompt(cr *completionRequest, chat bool, er *engine.Request) *httpError {
	p, herr := requestPrompt(w.tok, cr, chat)
	er.Prompt = p
	return herr
}

// requestPrompt is a request's prompt as token ids: the token ids from the
// router win; else the chat messages, or the prompt's text or ids. The
// router tokenizes with it too (kv_cache_aware), so both agree.
func requestPrompt(tok engine.Tokenizer, cr *completionRequest, chat bool) ([]int32, *httpError) {
	var p []int32
	switch {
	case len(cr.PromptTokenIDs) > 0:
		p = cr.PromptTokenIDs
	case chat:
		if len(cr.Messages) == 0 {
			return nil, badRequest("messages: at least one message is required")
		}
		p = tok.Encode(chatTemplate(cr.Messages))
	default:
		var herr *httpError
		if p, herr = parsePrompt(tok, cr.Prompt); herr != nil {
			return nil, herr
		}
	}
	if len(p) > MaxPromptTokens {
		return nil, badRequest("prompt of %d tokens exceeds %d", len(p), MaxPromptTokens)
	}
	return p, nil
}

// parseSampling sets er's length, sampling and stop strings.
func parseSampling(cr *completionRequest, er *engine.Request) *httpError {
	if cr.MaxTokens == nil {
		cr.MaxTokens = cr.MaxCompletion
	}
	if cr.MaxTokens != nil {
		if *cr.MaxTokens < 1 || *cr.MaxTokens > 1<<16 {
			return badRequest("max_tokens = %d, want 1..65536", *cr.MaxTokens)
		}
		er.MaxTokens = *cr.MaxTokens
	}
	if cr.Temperature != nil {
		if *cr.Temperature < 0 || *cr.Temperature > 2 {
			return badRequest("temperature = %v, want 0..2", *cr.Temperature)
		}
		er.Sampling.Temperature = *cr.Temperature
	}
	er.Sampling.Seed = cr.Seed
	stop, herr := parseStop(cr.Stop)
	if herr != nil {
		return herr
	}
	er.Stop, er.IgnoreEOS = stop, cr.IgnoreEOS
	return nil
}

// parseDisagg sets er's type from disaggregated_params, which must be one
// this worker's role serves, and for generation_only its context phase,
// whose opaque state the transceiver checks here: before the request is
// queued and blocks are taken for it.
func (w *Worker) parseDisagg(cr *completionRequest, er *engine.Request) *httpError {
	typ := TypeContextAndGeneration
	if cr.Disagg != nil {
		if err := cr.Disagg.validate(); err != nil {
			return badRequest("%v", err)
		}
		typ = cr.Disagg.RequestType
		if len(cr.Disagg.DraftTokens) > 0 {
			w.draftOnce.Do(func() {
				w.log.Warn("disaggregated_params.draft_tokens accepted but not used: kvxfer has no speculative decoding; " +
					"the tokens ride with the context phase unchanged")
			})
		}
	}
	allowed := map[string][]string{RoleContext: {TypeContextOnly}, RoleGeneration: {TypeGenerationOnly},
		RoleBoth: {TypeContextAndGeneration, TypeContextOnly, TypeGenerationOnly}}[w.role]
	served := slices.Contains(allowed, typ)
	if w.role == RoleGeneration && cr.Disagg != nil && typ == TypeContextAndGeneration {
		// Conditional disaggregation: the router sends a prompt the worker
		// has mostly cached as context_and_generation, saying so; a plain
		// request is still refused, as a misrouted one.
		served = true
	}
	if !served {
		return badRequest("this is a %s worker: it serves %s requests, not %s (set disaggregated_params.request_type, or send plain requests to the router)",
			w.role, strings.Join(allowed, " and "), typ)
	}
	if typ != TypeContextAndGeneration && w.tr == nil {
		return &httpError{http.StatusBadRequest, "invalid_request_error",
			fmt.Sprintf("%s requests need a transceiver and this worker has no cache_transceiver_config: %v", typ, transceiver.ErrNoTransceiver)}
	}
	switch typ {
	case TypeContextOnly:
		er.Type = transceiver.ContextOnly
	case TypeGenerationOnly:
		er.Type = transceiver.GenerationOnly
		opaque, err := base64.StdEncoding.DecodeString(cr.Disagg.EncodedOpaqueState)
		if err != nil {
			return badRequest("disaggregated_params.encoded_opaque_state is not base64: %v", err)
		}
		// Signature, expiry, replay and allowed peers are checked here, and
		// again (with the nonce recorded) when the transfer starts.
		if _, err := w.tr.CheckOpaque(opaque); err != nil {
			code, typ := statusOf(err)
			return &httpError{code, typ, fmt.Sprintf("disaggregated_params.encoded_opaque_state: %v", err)}
		}
		er.ContextPhase = &transceiver.ContextPhaseParams{CtxRequestID: *cr.Disagg.CtxRequestID,
			FirstGenTokens: cr.Disagg.FirstGenTokens, DraftTokens: cr.Disagg.DraftTokens, OpaqueState: opaque}
	}
	return nil
}

func parsePrompt(tok engine.Tokenizer, raw json.RawMessage) ([]int32, *httpError) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, badRequest("prompt is required")
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		if s == "" {
			return nil, badRequest("prompt is empty")
		}
		return tok.Encode(s), nil
	}
	var ids []int32
	if err := json.Unmarshal(raw, &ids); err == nil {
		if len(ids) == 0 {
			return nil, badRequest("prompt is an empty list of token ids")
		}
		return ids, nil
	}
	var ss []string
	if err := json.Unmarshal(raw, &ss); err == nil {
		if len(ss) != 1 {
			return nil, badRequest("prompt is a list of %d strings: kvxfer serves one prompt per request", len(ss))
		}
		return tok.Encode(ss[0]), nil
	}
	return nil, badRequest("prompt must be a string, a list of token ids or a list of one string")
}

func parseStop(raw json.RawMessage) ([]string, *httpError) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []string{s}, nil
	}
	var ss []string
	if err := json.Unmarshal(raw, &ss); err != nil {
		return nil, badRequest("stop must be a string or a list of strings")
	}
	if len(ss) > engine.MaxStopStrings {
		return nil, badRequest("stop has %d strings, at most %d", len(ss), engine.MaxStopStrings)
	}
	return ss, nil
}

// chatTemplate is the reference models' simple chat format.
func chatTemplate(msgs []chatMessage) string {
	var b strings.Builder
	for _, m := range msgs {
		fmt.Fprintf(&b, "<|%s|>\n%s\n", m.Role, m.Content)
	}
	b.WriteString("<|assistant|>\n")
	return b.String()
}

// statusOf maps an engine or transfer error to an HTTP status.
//
// Opaque states refused by the transceiver's checks: 403 for an unsigned,
// forged or replayed state and for an endpoint on a host this worker may not
// dial (retrying cannot help); 410 Gone for an expired one (the context
// worker has released its KV cache: run the context phase again); 503 when
// the worker remembers as many unexpired states as it may (retry later).
func statusOf(err error) (int, string) {
	var tl *engine.TooLongError
	switch {
	case errors.Is(err, transceiver.ErrUnsignedOpaqueState):
		return http.StatusForbidden, "opaque_state_unsigned"
	case errors.Is(err, transceiver.ErrForgedOpaqueState):
		return http.StatusForbidden, "opaque_state_forged"
	case errors.Is(err, transceiver.ErrReplayedOpaqueState):
		return http.StatusForbidden, "opaque_state_replayed"
	case errors.Is(err, transceiver.ErrPeerNotAllowed):
		return http.StatusForbidden, "peer_not_allowed"
	case errors.Is(err, transceiver.ErrExpiredOpaqueState):
		return http.StatusGone, "opaque_state_expired"
	case errors.Is(err, transceiver.ErrReplayCacheFull):
		return http.StatusServiceUnavailable, "replay_cache_full"
	case errors.As(err, &tl):
		return http.StatusBadRequest, "context_length_exceeded"
	case errors.Is(err, engine.ErrBadRequest), errors.Is(err, transceiver.ErrBadOpaqueState), errors.Is(err, transceiver.ErrPromptMismatch):
		return http.StatusBadRequest, "invalid_request_error"
	case errors.Is(err, transceiver.ErrRefused):
		// The context request is unknown, expired, cancelled or already
		// pulled, or the layouts are incompatible.
		return http.StatusConflict, "kv_transfer_refused"
	case errors.Is(err, transceiver.ErrTimeout):
		return http.StatusGatewayTimeout, "kv_transfer_timeout"
	case errors.Is(err, transceiver.ErrPeerLost), errors.Is(err, transceiver.ErrPeerAborted):
		return http.StatusBadGateway, "kv_transfer_failed"
	case errors.Is(err, engine.ErrQueueFull):
		return http.StatusTooManyRequests, "queue_full"
	case errors.Is(err, engine.ErrClosed):
		return http.StatusServiceUnavailable, "shutting_down"
	case errors.Is(err, context.Canceled):
		return 499, "cancelled"
	}
	return http.StatusInternalServerError, "internal_error"
}
