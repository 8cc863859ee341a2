package serve

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// MaxBody bounds a request body accepted by the router and the workers.
const MaxBody = 8 << 20

// Policy chooses a server of a group for each request.
type Policy string

// Policies.
const (
	RoundRobin    Policy = "round_robin"
	LoadBalancing Policy = "load_balancing" // fewest requests in flight
	// KVCacheAware and Conversation are TensorRT-LLM's policies that the
	// router does not implement yet: a group configured with one is routed
	// with config.RouterFallback (load_balancing), and NewRouter logs a
	// warning that says so.
	KVCacheAware Policy = config.RouterKVCacheAware
	Conversation Policy = config.RouterConversation
)

// upstream is one worker URL with its in-flight count.
type upstream struct {
	url      string
	inflight atomic.Int64
}

// group is the context or generation servers with their policy.
type group struct {
	name    string
	policy  Policy
	servers []*upstream
	next    atomic.Uint64
}

// order returns the servers to try, best first.
func (g *group) order() []*upstream {
	n := len(g.servers)
	out := make([]*upstream, 0, n)
	switch g.policy {
	case LoadBalancing:
		out = append(out, g.servers...)
		// Fewest in flight first; ties by round robin so load spreads.
		start := int(g.next.Add(1) % uint64(n))
		rot := append(out[start:], out[:start]...)
		out = make([]*upstream, 0, n)
		for len(rot) > 0 {
			best := 0
			for i, s := range rot {
				if s.inflight.Load() < rot[best].inflight.Load() {
					best = i
				}
			}
			out = append(out, rot[best])
			rot = append(rot[:best:best], rot[best+1:]...)
		}
	default:
		start := int(g.next.Add(1) % uint64(n))
		for i := range n {
			out = append(out, g.servers[(start+i)%n])
		}
	}
	return out
}

// RouterOptions configure a Router.
type RouterOptions struct {
	Context, Generation             []string // worker base URLs ("http://host:port" or "host:port")
	ContextPolicy, GenerationPolicy Policy
	Logger                          *slog.Logger
	// Client is used for upstream requests; nil means a default with
	// timeouts suited to streaming (NewHTTPClient(TLS)).
	Client *http.Client
	// TLS, when non-nil, is the router's client side of mutual TLS with
	// the workers (tlsconf.Config.Client): worker URLs without a scheme
	// get https://, http:// ones are refused, and the default client
	// presents the router's certificate and verifies the workers' against
	// the cluster CA. The router's own listener is not affected.
	TLS *tls.Config
}

// Router is the disaggregated router: it sends each request to a context
// worker as context_only, then to a generation worker as generation_only
// with the context's disaggregated_params and prompt token ids, and returns
// (or streams) the generation worker's answer. Safe for concurrent use.
type Router struct {
	prefill, gen *group
	client       *http.Client
	log          *slog.Logger
	reg          *prometheus.Registry
	m            *metrics.Router
	rl           *netlimit.RateLog // repeated warnings, one line per cause per second
}

// NewRouter builds a router. It starts no goroutines.
func NewRouter(o RouterOptions) (*Router, error) {
	if len(o.Context) == 0 || len(o.Generation) == 0 {
		return nil, fmt.Errorf("serve: router needs at least one context and one generation server (have %d and %d)", len(o.Context), len(o.Generation))
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	mk := func(name string, urls []string, p Policy) (*group, error) {
		switch p {
		case "":
			p = RoundRobin
		case RoundRobin, LoadBalancing:
		case KVCacheAware, Conversation:
			fb := Policy(config.RouterFallback)
			log.Warn("router policy not implemented yet: using "+string(fb)+" instead", "group", name, "policy", string(p), "using", string(fb))
			p = fb
		default:
			return nil, fmt.Errorf("serve: %s router policy %q (valid: %s, %s; %s and %s fall back to %s)",
				name, p, RoundRobin, LoadBalancing, KVCacheAware, Conversation, config.RouterFallback)
		}
		g := &group{name: name, policy: p}
		for _, u := range urls {
			nu, err := upstreamURL(u, o.TLS != nil)
			if err != nil {
				return nil, err
			}
			g.servers = append(g.servers, &upstream{url: nu})
		}
		return g, nil
	}
	cg, err := mk("context", o.Context, o.ContextPolicy)
	if err != nil {
		return nil, err
	}
	gg, err := mk("generation", o.Generation, o.GenerationPolicy)
	if err != nil {
		return nil, err
	}
	client := o.Client
	if client == nil {
		client = NewHTTPClient(o.TLS)
	}
	r := &Router{prefill: cg, gen: gg, client: client, log: log, reg: metrics.NewRegistry(), rl: netlimit.NewRateLog(log, time.Second)}
	r.m = metrics.NewRouter(r.reg)
	return r, nil
}

// newUpstreamTransport is the transport of the router's default client;
// tc, when set, is its client side of mutual TLS.
func newUpstreamTransport(tc *tls.Config) *http.Transport {
	return &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost:   64,
		ResponseHeaderTimeout: 10 * time.Minute,
		TLSClientConfig:       tc,
		TLSHandshakeTimeout:   10 * time.Second,
		// Below a worker's HTTP idle timeout (DefaultHTTPIdleTimeout), so
		// that the router drops an idle connection before the worker closes
		// it under a request (a POST is not retried).
		IdleConnTimeout: 90 * time.Second,
	}
}

// Handler returns the router's HTTP handler.
func (r *Router) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, req *http.Request) { r.route(w, req, "/v1/completions") })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, req *http.Request) { r.route(w, req, "/v1/chat/completions") })
	mux.HandleFunc("GET /v1/models", r.models)
	mux.HandleFunc("GET /health", r.health)
	mux.Handle("GET /metrics", metrics.Handler(r.reg))
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", fmt.Sprintf("no route %s %s (routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics)", req.Method, req.URL.Path))
	})
	return countCodes(mux, r.m.HTTPRequests)
}

// Close closes the idle upstream connections. Requests in flight finish.
// Idempotent.
func (r *Router) Close() { r.client.CloseIdleConnections() }

// Registry returns the router's metrics registry.
func (r *Router) Registry() *prometheus.Registry { return r.reg }

// route runs the disaggregated flow of one completion request.
func (r *Router) route(w http.ResponseWriter, req *http.Request, path string) {
	start := time.Now()
	defer func() { r.m.Latency.WithLabelValues(path).Observe(time.Since(start).Seconds()) }()
	orig, stream, err := readRouted(req)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	// 1. Context phase: context_only, never streamed.
	cr := r.contextPhase(req.Context(), w, path, orig, stream)
	if cr == nil {
		return
	}
	// 2. Generation phase.
	genReq := maps.Clone(orig)
	dp := cr.params
	dp.RequestType = TypeGenerationOnly
	genReq.set("disaggregated_params", dp)
	if len(cr.ids) > 0 {
		if path == "/v1/completions" {
			genReq.set("prompt", cr.ids)
		} else {
			genReq.set("prompt_token_ids", cr.ids)
		}
	}
	resp, err := r.post(req.Context(), r.gen, path, genReq)
	if err != nil || resp.StatusCode != http.StatusOK {
		// Refused, failed, or the client went away: no generation worker
		// will pull this context request, so the context worker releases
		// it now instead of at kv_transfer_timeout_ms.
		r.releaseContext(req.Context(), cr)
	}
	relay(w, resp, err, flushCopy)
}

// releaseContext asks the context worker that served cr to cancel it
// (CancelContextPath), proving ownership with the opaque state. It runs
// past the client's cancellation, bounded by its own deadline; a failure
// only leaves the request to its deadline.
func (r *Router) releaseContext(ctx context.Context, cr *contextResult) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	b, _ := json.Marshal(cr.params)
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, cr.server+CancelContextPath, bytes.NewReader(b))
	if err != nil {
		return
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := r.client.Do(hreq)
	if err != nil {
		r.warn("release-error:"+cr.server, "cannot release an abandoned context request: it stays until its deadline",
			"url", cr.server, "err", err)
		return
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	result := "released"
	if resp.StatusCode != http.StatusOK {
		result = "not_held" // pulled, expired or already cancelled
	}
	r.m.Upstream.WithLabelValues(r.prefill.name, result).Inc()
	r.log.Debug("abandoned context request", "url", cr.server, "ctx_request", cr.id(), "result", result)
}

// releaseTimeout bounds a release call to a context worker.
const releaseTimeout = 5 * time.Second

// relay answers w with an upstream answer (its headers and status, and its
// body through copyBody), or with 502 when err says there is none.
func relay(w http.ResponseWriter, resp *http.Response, err error, copyBody func(http.ResponseWriter, io.Reader)) {
	if err != nil {
		writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return
	}
	defer resp.Body.Close()
	copyHeaders(w, resp)
	w.WriteHeader(resp.StatusCode)
	copyBody(w, resp.Body)
}

// readRouted reads a client's request to the router: a JSON object without
// disaggregated_params (the router sets them), and whether it asks for a
// stream.
func readRouted(req *http.Request) (object, bool, error) {
	body, err := readBody(req)
	if err != nil {
		return nil, false, err
	}
	var orig object
	if err := json.Unmarshal(body, &orig); err != nil || orig == nil {
		return nil, false, errors.New("request body must be a JSON object")
	}
	if _, ok := orig["disaggregated_params"]; ok {
		return nil, false, errors.New("disaggregated_params is set by the router; send the plain OpenAI request")
	}
	var stream bool
	if _, err := orig.get("stream", &stream); err != nil {
		return nil, false, err
	}
	return orig, stream, nil
}

// contextResult is what the generation phase takes from the context
// phase's answer.
type contextResult struct {
	params DisaggregatedParams
	ids    []int32 // the prompt's token ids
	server string  // the context worker's base URL
}

func (c *contextResult) id() uint64 {
	if c.params.CtxRequestID == nil {
		return 0
	}
	return *c.params.CtxRequestID
}

// contextPhase sends orig to a context server as context_only. When the
// request ends there (an error, or an answer that finished in the context
// phase) it has answered w and returns nil.
func (r *Router) contextPhase(ctx context.Context, w http.ResponseWriter, path string, orig object, stream bool) *contextResult {
	prefillReq := maps.Clone(orig)
	prefillReq.set("stream", false)
	delete(prefillReq, "stream_options")
	prefillReq.set("disaggregated_params", DisaggregatedParams{RequestType: TypeContextOnly})
	resp, err := r.post(ctx, r.prefill, path, prefillReq)
	if err != nil {
		writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return nil
	}
	prefillBody, err := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
	resp.Body.Close()
	if err != nil {
		writeError(w, http.StatusBadGateway, "upstream_error", "reading the context server's answer: "+err.Error())
		return nil
	}
	if resp.StatusCode != http.StatusOK {
		copyHeaders(w, resp)
		w.WriteHeader(resp.StatusCode)
		w.Write(prefillBody)
		return nil
	}
	var cr struct {
		Choices []struct {
			FinishReason        *string              `json:"finish_reason"`
			DisaggregatedParams *DisaggregatedParams `json:"disaggregated_params"`
			PromptTokenIDs      []int32              `json:"prompt_token_ids"`
		} `json:"choices"`
		PromptTokenIDs []int32 `json:"prompt_token_ids"`
	}
	if err := json.Unmarshal(prefillBody, &cr); err != nil || len(cr.Choices) == 0 {
		writeError(w, http.StatusBadGateway, "upstream_error", "the context server's answer has no choices")
		return nil
	}
	ch := cr.Choices[0]
	if fr := ch.FinishReason; fr == nil || *fr != "length" && *fr != "not_finished" {
		// Finished in the context phase (EOS or a stop string as the first
		// token): that is the answer.
		r.replayFinished(w, prefillBody, stream)
		return nil
	}
	if ch.DisaggregatedParams == nil {
		writeError(w, http.StatusBadGateway, "upstream_error", "the context server's answer has no disaggregated_params")
		return nil
	}
	ids := cr.PromptTokenIDs
	if len(ids) == 0 {
		ids = ch.PromptTokenIDs
	}
	return &contextResult{params: *ch.DisaggregatedParams, ids: ids, server: strings.TrimSuffix(resp.Request.URL.String(), path)}
}

// replayFinished returns a context-phase answer that already finished; a
// streaming client gets it as one chunk and [DONE].
func (r *Router) replayFinished(w http.ResponseWriter, body []byte, stream bool) {
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		w.Write(body)
		return
	}
	// As a stream: one chunk, then [DONE]. A chat answer's message becomes
	// the chunk's delta, as streaming chat clients expect.
	var o object
	json.Unmarshal(body, &o)
	var typ string
	o.get("object", &typ)
	if typ == "chat.completion" {
		o.set("object", "chat.completion.chunk")
		var choices []object
		o.get("choices", &choices)
		for _, c := range choices {
			if m, ok := c["message"]; ok {
				c["delta"] = m
				delete(c, "message")
			}
		}
		o.set("choices", choices)
	}
	chunk, _ := json.Marshal(o)
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", chunk)
}

// post sends body to the group's servers in policy order, moving to the next
// server only when one cannot be reached (nothing was sent).
func (r *Router) post(ctx context.Context, g *group, path string, body object) (*http.Response, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	var errs []error
	for _, s := range g.order() {
		hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url+path, bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		hreq.Header.Set("Content-Type", "application/json")
		s.inflight.Add(1)
		resp, err := r.client.Do(hreq)
		if err != nil {
			s.inflight.Add(-1)
			var op *net.OpError
			if errors.As(err, &op) && op.Op == "dial" {
				r.m.Upstream.WithLabelValues(g.name, "connect_error").Inc()
				r.warn("unreachable:"+s.url, "worker unreachable, trying the next", "role", g.name, "url", s.url, "err", err)
				errs = append(errs, fmt.Errorf("%s: %v", s.url, err))
				continue
			}
			r.m.Upstream.WithLabelValues(g.name, "error").Inc()
			return nil, fmt.Errorf("%s server %s: %w", g.name, s.url, err)
		}
		result := "ok"
		if resp.StatusCode != http.StatusOK {
			result = "http_error"
		}
		r.m.Upstream.WithLabelValues(g.name, result).Inc()
		resp.Body = &doneBody{ReadCloser: resp.Body, done: func() { s.inflight.Add(-1) }}
		return resp, nil
	}
	return nil, fmt.Errorf("no %s server reachable: %w", g.name, errors.Join(errs...))
}

// warn logs a warning, at most one line per key per second (with the
// count of those left out).
func (r *Router) warn(key, msg string, args ...any) { r.rl.Warn(key, msg, args...) }

// doneBody runs done once when the body is closed.
type doneBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (d *doneBody) Close() error {
	err := d.ReadCloser.Close()
	d.once.Do(d.done)
	return err
}

func (r *Router) models(w http.ResponseWriter, req *http.Request) {
	resp, err := r.get(req.Context(), r.gen, "/v1/models")
	relay(w, resp, err, func(w http.ResponseWriter, body io.Reader) { io.Copy(w, io.LimitReader(body, MaxBody)) })
}

func (r *Router) get(ctx context.Context, g *group, path string) (*http.Response, error) {
	var errs []error
	for _, s := range g.order() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.url+path, nil)
		resp, err := r.client.Do(req)
		if err == nil {
			return resp, nil
		}
		errs = append(errs, err)
	}
	return nil, errors.Join(errs...)
}

// health is 200 when at least one context and one generation worker answer
// their /health with 200, else 503; the body lists every worker.
func (r *Router) health(w http.ResponseWriter, req *http.Request) {
	ctx, cancel := context.WithTimeout(req.Context(), 2*time.Second)
	defer cancel()
	type state struct {
		URL     string `json:"url"`
		Healthy bool   `json:"healthy"`
		Error   string `json:"error,omitempty"`
	}
	check := func(g *group) []state {
		out := make([]state, len(g.servers))
		var wg sync.WaitGroup
		for i, s := range g.servers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				out[i] = state{URL: s.url}
				hr, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/health", nil)
				resp, err := r.client.Do(hr)
				if err != nil {
					out[i].Error = err.Error()
					return
				}
				io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
				resp.Body.Close()
				out[i].Healthy = resp.StatusCode == http.StatusOK
				if !out[i].Healthy {
					out[i].Error = resp.Status
				}
			}()
		}
		wg.Wait()
		return out
	}
	cs, gs := check(r.prefill), check(r.gen)
	anyHealthy := func(ss []state) bool {
		for _, s := range ss {
			if s.Healthy {
				return true
			}
		}
		return false
	}
	ok := anyHealthy(cs) && anyHealthy(gs)
	code, status := http.StatusOK, "ok"
	if !ok {
		code, status = http.StatusServiceUnavailable, "unavailable"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"status": status, "context_servers": cs, "generation_servers": gs})
}
