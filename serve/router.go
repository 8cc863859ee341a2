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
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/memstore"
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
	// KVCacheAware sends a request to the worker with the best score of
	// cached prefix and load, as TensorRT-LLM's: the fraction of the
	// prompt's blocks the worker holds (from its KV cache events, which
	// the router polls) less its requests in flight over
	// config.RouterArgs.MaxBatchSize; ties, empty caches included, go
	// round robin.
	KVCacheAware Policy = config.RouterKVCacheAware
	// Conversation keeps a conversation on the worker that served it: by
	// the request's conversation_id (or TensorRT-LLM's
	// disaggregated_params.conversation_id), else by the longest shared
	// prefix of an earlier request (config.RouterArgs.MatchThreshold);
	// a new conversation, or one whose worker left or is down, goes to the
	// least loaded worker. At most config.RouterArgs.MaxSessions
	// conversations are remembered, least recently used evicted.
	Conversation Policy = config.RouterConversation
)

// upstream is one worker URL with its in-flight count and its local
// state: a worker that missed a deadline is down (the policies try it last)
// until a probe of its /health answers.
type upstream struct {
	url      string
	inflight atomic.Int64
	down     atomic.Bool

	mu     sync.Mutex
	reason string    // why it was marked down
	since  time.Time // when

	// Dynamic membership (disagg_cluster): member is the worker's record
	// when it registered itself (nil for a static url of the cluster
	// file); removed is set when it left the membership (its lease ended
	// or it deregistered): its probes stop.
	member  atomic.Pointer[membership.WorkerInfo]
	removed atomic.Bool

	// kv is what the router knows of the worker's reusable KV cache
	// (kv_cache_aware); polling is set while a poll of its events runs.
	kv      *kvSet
	polling atomic.Bool
}

func newUpstream(url string) *upstream { return &upstream{url: url, kv: newKVSet()} }

// state returns whether s is marked down, why and since when.
func (s *upstream) state() (bool, string, time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.down.Load(), s.reason, s.since
}

// group is the context or generation servers with their policy.
type group struct {
	name   string
	policy Policy
	mu     sync.RWMutex // guards servers (replaced, never changed in place, when members join or leave)
	// servers are the static urls of the cluster file, then the workers
	// that registered themselves.
	servers []*upstream
	next    atomic.Uint64

	// tokensPerBlock (kv_cache_aware) is the workers' block size, which
	// the router hashes prompts with; args are the router block's; conv
	// is the conversation policy's memory.
	tokensPerBlock int
	args           config.RouterArgs
	conv           *sessions
}

// list returns the group's servers now.
func (g *group) list() []*upstream {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.servers
}

// order returns the servers to try, best first, for a request the policy
// knows nothing of.
func (g *group) order() []*upstream {
	o, _ := g.orderFor(nil)
	return o
}

// orderFor returns the servers to try for ri (nil: a request of no
// particular prompt), best first, and for the conversation policy the
// conversation ri continues.
func (g *group) orderFor(ri *routeInfo) ([]*upstream, string) {
	servers := g.list()
	if len(servers) == 0 {
		return nil, ""
	}
	if ri != nil && ri.only != nil {
		return []*upstream{ri.only}, ""
	}
	var out []*upstream
	var conv string
	switch g.policy {
	case LoadBalancing:
		out = g.orderLoad(servers)
	case KVCacheAware:
		out = g.orderKVAware(servers, ri)
	case Conversation:
		out, conv = g.orderConversation(servers, ri)
	default:
		n := len(servers)
		start := int(g.next.Add(1) % uint64(n))
		for i := range n {
			out = append(out, servers[(start+i)%n])
		}
	}
	// Workers marked down go last: tried only when no other can be
	// reached.
	slices.SortStableFunc(out, func(a, b *upstream) int {
		ad, bd := a.down.Load(), b.down.Load()
		switch {
		case ad == bd:
			return 0
		case bd:
			return -1
		}
		return 1
	})
	return out, conv
}

// orderLoad orders servers by fewest in flight; ties by round robin so
// load spreads.
func (g *group) orderLoad(servers []*upstream) []*upstream {
	n := len(servers)
	start := int(g.next.Add(1) % uint64(n))
	rot := append(slices.Clone(servers[start:]), servers[:start]...)
	out := make([]*upstream, 0, n)
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
	// RouterDeadlines are the per-phase deadlines.
	RouterDeadlines
	// MigrationLimit is the most times one request migrates to another
	// generation worker when its generation worker fails mid-request (as
	// Dynamo's --migration-limit): 0 means DefaultMigrationLimit,
	// MigrationOff (or any negative value) turns migration off.
	MigrationLimit int
	// Cluster, when set, is the disagg_cluster whose workers register
	// themselves: the router watches its store and routes to its members
	// besides Context and Generation (which may then be empty).
	Cluster *ClusterOptions

	// ContextArgs and GenerationArgs are the groups' router arguments
	// (kv_cache_aware, conversation); zero fields take
	// config.DefaultRouterArgs'.
	ContextArgs, GenerationArgs config.RouterArgs
	// ContextTokensPerBlock and GenerationTokensPerBlock are the workers'
	// kv_cache_config.tokens_per_block, with which kv_cache_aware hashes
	// prompts as their caches do; 0 means config.DefaultTokensPerBlock.
	ContextTokensPerBlock, GenerationTokensPerBlock int
	// KVEventsInterval is how often kv_cache_aware polls each worker's KV
	// cache events (besides a poll when a request ends); 0 means
	// DefaultKVEventsInterval.
	KVEventsInterval time.Duration
	// ConditionalDisagg, when set, is conditional_disagg_config: see
	// Router.
	ConditionalDisagg *config.ConditionalDisagg
	// Secret is the cluster secret: the router proves it (ReuseToken) to
	// the workers' KV cache event and cached-prefix routes.
	Secret []byte
}

// DefaultMigrationLimit is RouterOptions.MigrationLimit's default, and
// that of kvxfer router's and kvxfer up's --migration-limit.
const DefaultMigrationLimit = 1

// MigrationOff in RouterOptions.MigrationLimit turns migration off.
const MigrationOff = -1

// RouterDeadlines are a router's per-phase deadlines (zero: the default;
// see the Default constants). A worker that misses one is marked down: the policies try it last,
// and it is probed (GET /health every ProbeInterval, each within
// HealthTimeout) until it answers.
//
// HeaderTimeout bounds the wait for a worker's response headers; a
// context worker sends them after the prefill, so this bounds the
// longest prefill too. ChunkTimeout bounds the wait for each read of a
// response body (the gap between two stream chunks). HealthTimeout
// bounds each worker's answer to a health probe, in the router's
// /health as in the probes of workers marked down.
type RouterDeadlines struct {
	HeaderTimeout, ChunkTimeout, HealthTimeout, ProbeInterval time.Duration
}

// Deadlines returns the router's per-phase deadlines, defaults filled in.
func (r *Router) Deadlines() RouterDeadlines { return r.d }

// MigrationLimit returns the most migrations of one request; 0 when
// migration is off.
func (r *Router) MigrationLimit() int { return r.migration }

// Defaults of RouterOptions' deadlines. DefaultHeaderTimeout is
// trtllm-serve disaggregated's --request_timeout default.
const (
	DefaultHeaderTimeout = 180 * time.Second
	DefaultChunkTimeout  = 30 * time.Second
	DefaultHealthTimeout = 2 * time.Second
	DefaultProbeInterval = time.Second
)

// Router is the disaggregated router: it sends each request to a context
// worker as context_only, then to a generation worker as generation_only
// with the context's disaggregated_params and prompt token ids, and returns
// (or streams) the generation worker's answer. When the generation worker
// fails mid-request, the request migrates to another one
// (RouterOptions.MigrationLimit; see routeMigrating). With
// conditional_disagg_config (RouterOptions.ConditionalDisagg) it first
// asks the generation worker its policy picks how much of the prompt it
// has cached, and sends a prompt with some cached and at most
// MaxLocalPrefillLength left to compute there as context_and_generation
// (tryLocal). Safe for concurrent use.
type Router struct {
	prefill, gen *group
	client       *http.Client
	log          *slog.Logger
	reg          *prometheus.Registry
	m            *metrics.Router
	rl           *netlimit.RateLog // repeated warnings, one line per cause per second

	d         RouterDeadlines // with the defaults filled in
	migration int             // MigrationLimit resolved: 0 is off

	// afterContext, when set (by tests), runs between the context and the
	// generation phases of each request.
	afterContext func(ctx context.Context)

	life      context.Context // cancelled by Close: stops the probes
	stop      context.CancelFunc
	probes    sync.WaitGroup
	closeOnce sync.Once

	// hlast is /health's newest round of probes, in flight or ended
	// (HealthReuse); hmu guards it. hepoch counts the workers marked down
	// or re-admitted: a round is not reused across a change.
	hmu    sync.Mutex
	hlast  *healthRound
	hepoch atomic.Uint64

	cluster *routerCluster // nil without disagg_cluster
	tls     bool           // worker URLs need https://

	// Reuse (kvroute.go): whether a policy reads the prompt, the
	// tokenizer it reads it with, the event poller, the bearer token of
	// the workers' reuse routes, conditional_disagg_config, and the
	// counter of the path each request took.
	needPrompt bool
	tok        engine.Tokenizer
	kvPolled   bool // a group is kv_cache_aware
	kvOnce     sync.Once
	kvNudge    chan struct{}
	kvInterval time.Duration
	reuseToken string
	cond       *config.ConditionalDisagg
	paths      *prometheus.CounterVec
}

// NewRouter builds a router. It starts no goroutines, except with
// RouterOptions.Cluster the one that watches the membership (Close stops
// it).
func NewRouter(o RouterOptions) (*Router, error) {
	if o.Cluster == nil && (len(o.Context) == 0 || len(o.Generation) == 0) {
		return nil, fmt.Errorf("serve: router needs at least one context and one generation server (have %d and %d)", len(o.Context), len(o.Generation))
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cg, err := newGroup("context", o.Context, o.ContextPolicy, o.ContextArgs, o.ContextTokensPerBlock, o.TLS != nil)
	if err != nil {
		return nil, err
	}
	gg, err := newGroup("generation", o.Generation, o.GenerationPolicy, o.GenerationArgs, o.GenerationTokensPerBlock, o.TLS != nil)
	if err != nil {
		return nil, err
	}
	client := o.Client
	if client == nil {
		client = NewHTTPClient(o.TLS)
	}
	r := &Router{prefill: cg, gen: gg, client: client, log: log, reg: metrics.NewRegistry(), rl: netlimit.NewRateLog(log, time.Second),
		d: RouterDeadlines{HeaderTimeout: durationOr(o.HeaderTimeout, DefaultHeaderTimeout), ChunkTimeout: durationOr(o.ChunkTimeout, DefaultChunkTimeout),
			HealthTimeout: durationOr(o.HealthTimeout, DefaultHealthTimeout), ProbeInterval: durationOr(o.ProbeInterval, DefaultProbeInterval)}}
	switch {
	case o.MigrationLimit == 0:
		r.migration = DefaultMigrationLimit
	case o.MigrationLimit > 0:
		r.migration = o.MigrationLimit
	}
	r.life, r.stop = context.WithCancel(context.Background())
	r.m = metrics.NewRouter(r.reg)
	r.tls = o.TLS != nil
	r.kvPolled = cg.policy == KVCacheAware || gg.policy == KVCacheAware
	r.needPrompt = r.kvPolled || cg.policy == Conversation || gg.policy == Conversation || o.ConditionalDisagg != nil
	r.kvNudge, r.kvInterval = make(chan struct{}, 1), durationOr(o.KVEventsInterval, DefaultKVEventsInterval)
	r.reuseToken, r.cond = ReuseToken(o.Secret), o.ConditionalDisagg
	r.paths = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_router_prefill_path_total",
		Help: "Requests routed, by where their prompt was prefilled: local (on the generation worker, conditional disaggregation) or disaggregated (on a context worker)."}, []string{"path"})
	r.reg.MustRegister(r.paths)
	r.updateWorkerGauge()
	if o.Cluster != nil {
		r.startCluster(*o.Cluster)
	}
	return r, nil
}

// durationOr is d, or def when d is not positive.
func durationOr(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// newGroup is the router's group name (context or generation) of the
// servers at urls (https with useTLS), routed by policy p (RoundRobin when
// empty) with args, defaults filled in.
func newGroup(name string, urls []string, p Policy, args config.RouterArgs, tpb int, useTLS bool) (*group, error) {
	switch p {
	case "":
		p = RoundRobin
	case RoundRobin, LoadBalancing, KVCacheAware, Conversation:
	default:
		return nil, fmt.Errorf("serve: %s router policy %q (valid: %s, %s, %s, %s)",
			name, p, RoundRobin, LoadBalancing, KVCacheAware, Conversation)
	}
	args = routerArgsWithDefaults(args)
	g := &group{name: name, policy: p, args: args, tokensPerBlock: intOr(tpb, config.DefaultTokensPerBlock)}
	if p == Conversation {
		g.conv = newSessions(args.MaxSessions, args.MatchThreshold)
	}
	for _, u := range urls {
		nu, err := upstreamURL(u, useTLS)
		if err != nil {
			return nil, err
		}
		g.servers = append(g.servers, newUpstream(nu))
	}
	return g, nil
}

// routerArgsWithDefaults is args with config.DefaultRouterArgs in place of
// the fields unset or out of range.
func routerArgsWithDefaults(args config.RouterArgs) config.RouterArgs {
	def := config.DefaultRouterArgs()
	args.MaxBatchSize, args.TokensPerBlock, args.MaxSessions = intOr(args.MaxBatchSize, def.MaxBatchSize), intOr(args.TokensPerBlock, def.TokensPerBlock), intOr(args.MaxSessions, def.MaxSessions)
	if args.MatchThreshold <= 0 || args.MatchThreshold > 1 {
		args.MatchThreshold = def.MatchThreshold
	}
	args.HashSkipCount = max(args.HashSkipCount, 0)
	return args
}

// intOr is v, or d when v is not positive.
func intOr(v, d int) int {
	if v <= 0 {
		return d
	}
	return v
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
	mux.HandleFunc("GET /cluster_info", r.clusterInfo)
	if r.cluster != nil && r.cluster.handler != nil {
		mux.Handle(memstore.BasePath+"/", r.cluster.handler)
	}
	mux.Handle("GET /metrics", metrics.Handler(r.reg))
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		writeError(w, http.StatusNotFound, "not_found", fmt.Sprintf("no route %s %s (routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /cluster_info, GET /metrics)", req.Method, req.URL.Path))
	})
	return countCodes(mux, r.m.HTTPRequests)
}

// Close stops the probes of workers marked down and a round of /health's
// in flight (see HealthReuse), and closes the idle upstream connections.
// Requests in flight finish. Idempotent.
func (r *Router) Close() {
	r.closeOnce.Do(func() {
		r.stop()
		r.probes.Wait()
	})
	r.client.CloseIdleConnections()
}

// Registry returns the router's metrics registry.
func (r *Router) Registry() *prometheus.Registry { return r.reg }

// route runs the disaggregated flow of one completion request.
func (r *Router) route(w http.ResponseWriter, req *http.Request, path string) {
	start := time.Now()
	defer func() { r.m.Latency.WithLabelValues(path).Observe(time.Since(start).Seconds()) }()
	orig, stream, herr := readRouted(req)
	if herr != nil {
		writeError(w, herr.code, herr.typ, herr.msg)
		return
	}
	if ok, role, why := r.ready(); !ok {
		writeNotReady(w, role, why)
		return
	}
	r.startKVPoller()
	defer r.nudgeKV()
	ri := r.newRouteInfo(path, orig)
	if r.tryLocal(w, req, path, orig, ri) {
		return
	}
	r.paths.WithLabelValues(RouteDisaggregated).Inc()
	w.Header().Set(RouteHeader, RouteDisaggregated)
	if r.migration > 0 {
		r.routeMigrating(w, req, path, orig, stream, ri)
		return
	}
	// 1. Context phase: context_only, never streamed.
	cr := r.contextPhase(req.Context(), w, path, orig, stream, ri)
	if cr == nil {
		return
	}
	if r.afterContext != nil {
		r.afterContext(req.Context())
	}
	// 2. Generation phase.
	genReq := generationRequest(path, orig, cr)
	resp, _, err := r.post(req.Context(), r.gen, path, genReq, nil, ri)
	if err != nil || resp.StatusCode != http.StatusOK {
		// Refused, failed, or the client went away: no generation worker
		// will pull this context request, so the context worker releases
		// it now instead of at kv_transfer_timeout_ms.
		r.releaseContext(req.Context(), cr)
	}
	relay(w, resp, err, streamCopy)
}

// generationRequest is orig as a generation_only request of the context
// phase cr.
func generationRequest(path string, orig object, cr *contextResult) object {
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
	return genReq
}

// streamCopy copies a generation worker's answer (flushCopyErr): a stream the
// worker cut (it died, or missed the chunk deadline) ends with an
// OpenAI-style error event and no [DONE], never with a silent end. The
// client's own departure ends it silently: nobody reads it.
func streamCopy(w http.ResponseWriter, body io.Reader) {
	err := flushCopyErr(w, body)
	if err == nil || errors.Is(err, errClientGone) || !strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream") {
		return
	}
	var e APIError
	e.Error.Message = "the generation worker's stream was cut: " + err.Error()
	e.Error.Type, e.Error.Code = "upstream_error", http.StatusBadGateway
	if errors.Is(err, errStalled) {
		e.Error.Type, e.Error.Code = "upstream_timeout", http.StatusGatewayTimeout
	}
	b, _ := json.Marshal(e)
	fmt.Fprintf(w, "data: %s\n\n", b)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
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
		upstreamFailed(w, err)
		return
	}
	defer resp.Body.Close()
	copyHeaders(w, resp)
	w.WriteHeader(resp.StatusCode)
	copyBody(w, resp.Body)
}

// notJSONObject says why a body did not decode as a JSON object: what it
// is instead, or where its JSON breaks.
func notJSONObject(err error) string {
	var typ *json.UnmarshalTypeError
	var syn *json.SyntaxError
	switch {
	case errors.As(err, &typ):
		return ", not a JSON " + typ.Value
	case errors.As(err, &syn):
		return fmt.Sprintf(": %v (at byte %d)", err, syn.Offset)
	}
	return ": " + err.Error()
}

// readRouted reads a client's request to the router: a JSON object without
// disaggregated_params (the router sets them), and whether it asks for a
// stream.
func readRouted(req *http.Request) (object, bool, *httpError) {
	body, herr := readBody(req)
	if herr != nil {
		return nil, false, herr
	}
	var orig object
	if err := json.Unmarshal(body, &orig); err != nil {
		return nil, false, badRequest("request body must be a JSON object%s", notJSONObject(err))
	}
	if orig == nil {
		return nil, false, badRequest("request body must be a JSON object, not null")
	}
	if herr := checkKeyCase(orig); herr != nil {
		return nil, false, herr
	}
	if err := takeConversation(orig); err != nil {
		return nil, false, badRequest("%v", err)
	}
	if _, ok := orig[ResumeField]; ok {
		return nil, false, badRequest("%s is set by the router when it migrates a request; send the plain OpenAI request", ResumeField)
	}
	var stream bool
	if _, err := orig.get("stream", &stream); err != nil {
		return nil, false, badRequest("%v", err)
	}
	return orig, stream, nil
}

// requestFields are the keys of a request the worker reads
// (completionRequest's JSON names), by their lowercase form.
var requestFields = func() map[string]string {
	m := map[string]string{}
	t := reflect.TypeFor[completionRequest]()
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
			m[strings.ToLower(name)] = name
		}
	}
	return m
}()

// checkKeyCase refuses a key that is a request field spelled otherwise
// ("Cache_Salt"): the worker decodes keys whatever their case
// (encoding/json), the router reads and refuses them only as spelled, so
// such a key would route a request as one thing and serve it as another
// (unsalted here, salted there), or pass a field the router keeps for
// itself.
func checkKeyCase(orig object) *httpError {
	for k := range orig {
		if name, ok := requestFields[strings.ToLower(k)]; ok && k != name {
			return badRequest("key %q is the request field %q spelled otherwise; send it as %q", k, name, name)
		}
	}
	return nil
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
func (r *Router) contextPhase(ctx context.Context, w http.ResponseWriter, path string, orig object, stream bool, ri *routeInfo) *contextResult {
	cr, out := r.runContext(ctx, path, orig, nil, ri)
	if cr == nil {
		r.writeOutcome(w, out, stream)
	}
	return cr
}

// contextOutcome is how a context phase ended the request: an error (no
// answer, or one the router cannot use), a worker's answer other than 200,
// or an answer that finished in the context phase.
type contextOutcome struct {
	err      error
	resp     *http.Response // the answer's status and headers (body read)
	body     []byte
	finished bool
}

// writeOutcome answers w with a context phase's outcome.
func (r *Router) writeOutcome(w http.ResponseWriter, o *contextOutcome, stream bool) {
	switch {
	case o.err != nil:
		upstreamFailed(w, o.err)
	case o.finished:
		r.replayFinished(w, o.body, stream)
	default:
		copyHeaders(w, o.resp)
		w.WriteHeader(o.resp.StatusCode)
		w.Write(o.body)
	}
}

// runContext sends orig to a context server as context_only (resumed
// after resume, when set). It returns the context phase to pull, or how the request ended.
func (r *Router) runContext(ctx context.Context, path string, orig object, resume []int32, ri *routeInfo) (*contextResult, *contextOutcome) {
	prefillReq := maps.Clone(orig)
	prefillReq.set("stream", false)
	delete(prefillReq, "stream_options")
	prefillReq.set("disaggregated_params", DisaggregatedParams{RequestType: TypeContextOnly})
	if len(resume) > 0 {
		prefillReq.set(ResumeField, resume)
	}
	resp, _, err := r.post(ctx, r.prefill, path, prefillReq, nil, ri)
	if err != nil {
		return nil, &contextOutcome{err: err}
	}
	prefillBody, err := readUpstream(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, &contextOutcome{err: fmt.Errorf("reading the context server's answer: %w", err)}
	}
	if resp.StatusCode != http.StatusOK {
		return nil, &contextOutcome{resp: resp, body: prefillBody}
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
		return nil, &contextOutcome{err: errors.New("the context server's answer has no choices")}
	}
	ch := cr.Choices[0]
	if fr := ch.FinishReason; fr == nil || *fr != "length" && *fr != "not_finished" {
		// Finished in the context phase (EOS or a stop string as the first
		// token): that is the answer.
		return nil, &contextOutcome{resp: resp, body: prefillBody, finished: true}
	}
	if ch.DisaggregatedParams == nil {
		return nil, &contextOutcome{err: errors.New("the context server's answer has no disaggregated_params")}
	}
	ids := cr.PromptTokenIDs
	if len(ids) == 0 {
		ids = ch.PromptTokenIDs
	}
	return &contextResult{params: *ch.DisaggregatedParams, ids: ids, server: strings.TrimSuffix(resp.Request.URL.String(), path)}, nil
}

// readUpstream reads a worker's whole answer, at most MaxBody bytes: a
// longer one is an error, never cut short into broken JSON.
func readUpstream(body io.Reader) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(body, MaxBody+1))
	if err == nil && len(b) > MaxBody {
		err = fmt.Errorf("the answer is over %d bytes (MaxBody)", MaxBody)
	}
	return b, err
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

// post sends body to the group's servers in policy order for ri (avoid,
// when set, last), moving to the next server only when one cannot be
// reached (nothing was sent). It returns the server it sent body to, also
// with an error after sending.
func (r *Router) post(ctx context.Context, g *group, path string, body object, avoid *upstream, ri *routeInfo) (*http.Response, *upstream, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return nil, nil, err
	}
	var errs []error
	order, conv := g.orderFor(ri)
	if i := slices.Index(order, avoid); i >= 0 {
		order = append(slices.Delete(order, i, i+1), avoid)
	}
	for _, s := range order {
		hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, s.url+path, bytes.NewReader(b))
		if err != nil {
			return nil, nil, err
		}
		hreq.Header.Set("Content-Type", "application/json")
		s.inflight.Add(1)
		resp, err := r.do(g, s, hreq)
		if err != nil {
			s.inflight.Add(-1)
			if errors.Is(err, errStalled) {
				return nil, s, err
			}
			var op *net.OpError
			if errors.As(err, &op) && op.Op == "dial" {
				r.m.Upstream.WithLabelValues(g.name, "connect_error").Inc()
				r.markDown(g, s, whyConnect+err.Error())
				r.warn("unreachable:"+s.url, "worker unreachable, trying the next", "role", g.name, "url", s.url, "err", err)
				errs = append(errs, fmt.Errorf("%s: %v", s.url, err))
				continue
			}
			r.m.Upstream.WithLabelValues(g.name, "error").Inc()
			if ctx.Err() == nil {
				r.markDown(g, s, "request failed: "+err.Error())
			}
			return nil, s, fmt.Errorf("%s server %s: %w", g.name, s.url, err)
		}
		result := "ok"
		if resp.StatusCode != http.StatusOK {
			result = "http_error"
		}
		r.m.Upstream.WithLabelValues(g.name, result).Inc()
		if resp.StatusCode < 400 && resp.StatusCode != http.StatusOK {
			// A redirect or another success: no completion, and nothing
			// a client of the router should be handed.
			resp.Body.Close()
			s.inflight.Add(-1)
			return nil, s, fmt.Errorf("%s server %s answered %s, not a completion (200) or an error", g.name, s.url, resp.Status)
		}
		g.served(ri, conv, s)
		resp.Body = &doneBody{ReadCloser: resp.Body, done: func() { s.inflight.Add(-1) }}
		return resp, s, nil
	}
	return nil, nil, fmt.Errorf("no %s server reachable: %w", g.name, errors.Join(errs...))
}

// warn logs a warning, at most one line per key per second (with the
// count of those left out).
func (r *Router) warn(key, msg string, args ...any) { r.rl.Warn(key, msg, args...) }

// errStalled marks the errors of a worker that missed a deadline.
var errStalled = errors.New("worker stalled")

// do sends hreq to s under the per-phase deadlines: the response headers
// within HeaderTimeout, then each read of the body within ChunkTimeout. A
// worker that misses one is marked down and the request fails with an
// error wrapping errStalled (a 504 for the client).
func (r *Router) do(g *group, s *upstream, hreq *http.Request) (*http.Response, error) {
	ctx, cancel := context.WithCancel(hreq.Context())
	timer := time.AfterFunc(r.d.HeaderTimeout, cancel)
	resp, err := r.client.Do(hreq.WithContext(ctx))
	if !timer.Stop() && hreq.Context().Err() == nil {
		if err == nil {
			resp.Body.Close()
		}
		cancel()
		why := fmt.Sprintf("no response headers within %v", r.d.HeaderTimeout)
		r.m.Upstream.WithLabelValues(g.name, "stalled").Inc()
		r.markDown(g, s, why)
		return nil, fmt.Errorf("%s server %s: %s: %w", g.name, s.url, why, errStalled)
	}
	if err != nil {
		cancel()
		return nil, err
	}
	sb := &stallBody{body: resp.Body, cancel: cancel, timeout: r.d.ChunkTimeout,
		stalled: func() {
			r.m.Upstream.WithLabelValues(g.name, "stalled").Inc()
			r.markDown(g, s, fmt.Sprintf("no response data within %v", r.d.ChunkTimeout))
		}}
	sb.timer = time.AfterFunc(time.Hour, sb.fire)
	sb.timer.Stop()
	resp.Body = sb
	return resp, nil
}

// stallBody is a response body whose every read must return within
// timeout; one that does not cancels the request (the read fails with an
// error wrapping errStalled) and calls stalled.
type stallBody struct {
	body    io.ReadCloser
	cancel  context.CancelFunc
	timeout time.Duration
	timer   *time.Timer
	stalled func()
	fired   atomic.Bool
}

func (b *stallBody) fire() {
	b.fired.Store(true)
	b.cancel()
	b.stalled()
}

func (b *stallBody) Read(p []byte) (int, error) {
	b.timer.Reset(b.timeout)
	n, err := b.body.Read(p)
	b.timer.Stop()
	if err != nil && b.fired.Load() {
		err = fmt.Errorf("no response data within %v: %w", b.timeout, errStalled)
	}
	return n, err
}

func (b *stallBody) Close() error {
	b.timer.Stop()
	err := b.body.Close()
	b.cancel()
	return err
}

// whyConnect starts the reason of a worker marked down because it could
// not be reached.
const whyConnect = "connection failed: "

// markDown marks s down for why and, if it was up, starts probing it.
func (r *Router) markDown(g *group, s *upstream, why string) {
	s.mu.Lock()
	was := s.down.Swap(true)
	if !was {
		s.reason, s.since = why, time.Now()
	}
	s.mu.Unlock()
	if was {
		return
	}
	r.hepoch.Add(1)
	r.updateWorkerGauge()
	if strings.HasPrefix(why, whyConnect) {
		// "worker unreachable" says it already, rate-limited.
		r.log.Debug("worker unreachable: marked down, probing it until it answers", "role", g.name, "url", s.url, "why", why)
	} else {
		r.warn("down:"+s.url, "worker failed or missed a deadline: marked down, probing it until it answers", "role", g.name, "url", s.url, "why", why)
	}
	r.probes.Add(1)
	go r.probe(g, s)
}

// markUp re-admits s after a health probe answered.
func (r *Router) markUp(g *group, s *upstream) {
	s.mu.Lock()
	was := s.down.Swap(false)
	s.reason = ""
	s.mu.Unlock()
	if was {
		r.hepoch.Add(1)
		r.updateWorkerGauge()
		r.log.Info("worker answers again: re-admitted", "role", g.name, "url", s.url)
	}
}

// probe checks s's /health every ProbeInterval until it answers 200 (s is
// re-admitted) or the router closes.
func (r *Router) probe(g *group, s *upstream) {
	defer r.probes.Done()
	t := time.NewTicker(r.d.ProbeInterval)
	defer t.Stop()
	for s.down.Load() && !s.removed.Load() {
		select {
		case <-r.life.Done():
			return
		case <-t.C:
		}
		if err := r.checkHealth(r.life, s); err == nil {
			r.markUp(g, s)
			return
		}
	}
}

// checkHealth asks s's /health, within HealthTimeout.
func (r *Router) checkHealth(ctx context.Context, s *upstream) error {
	ctx, cancel := context.WithTimeout(ctx, r.d.HealthTimeout)
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/health", nil)
	if err != nil {
		return err
	}
	resp, err := r.client.Do(hr)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("no answer within %v", r.d.HealthTimeout)
		}
		return err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errors.New(resp.Status)
	}
	return nil
}

// upstreamFailed answers w for a request no worker answered: 504 when a
// worker missed a deadline, else 502.
func upstreamFailed(w http.ResponseWriter, err error) {
	if errors.Is(err, errStalled) {
		writeError(w, http.StatusGatewayTimeout, "upstream_timeout", err.Error())
		return
	}
	writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
}

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

// models answers /v1/models with the first generation worker's that
// answers (503 while the cluster is not ready).
func (r *Router) models(w http.ResponseWriter, req *http.Request) {
	if ok, role, why := r.ready(); !ok {
		writeNotReady(w, role, why)
		return
	}
	resp, err := r.get(req.Context(), r.gen, "/v1/models")
	relay(w, resp, err, func(w http.ResponseWriter, body io.Reader) { io.Copy(w, io.LimitReader(body, MaxBody)) })
}

// get asks the group's servers for path in policy order, under the
// per-phase deadlines (do), until one answers.
func (r *Router) get(ctx context.Context, g *group, path string) (*http.Response, error) {
	var errs []error
	for _, s := range g.order() {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+path, nil)
		if err != nil {
			return nil, err
		}
		resp, err := r.do(g, s, req)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		errs = append(errs, fmt.Errorf("%s: %w", s.url, err))
	}
	if len(errs) == 0 {
		return nil, fmt.Errorf("no %s server to ask GET %s", g.name, path)
	}
	return nil, fmt.Errorf("no %s server answered GET %s: %w", g.name, path, errors.Join(errs...))
}

// HealthReuse is how long the router's /health answers from one round of
// probes. A round probes every worker at once, each within HealthTimeout;
// the calls that arrive while it runs wait for it, and those that arrive
// within HealthReuse after it ended get its results, so that /health costs
// the workers at most one probe each per HealthReuse, however many clients
// ask. A round is not reused once workers joined or left, or the router
// marked one down or re-admitted one: a client brings that about only with
// a request that fails on a worker marked up, so such rounds are at most
// two per failed request, whose own upstream request costs as much. A
// worker that goes down shows in /health within HealthReuse plus
// HealthTimeout.
const HealthReuse = time.Second

// healthRound is one round of probes of every worker for /health.
type healthRound struct {
	done    chan struct{}  // closed when every probe has ended
	servers [2][]*upstream // the context and generation servers probed
	epoch   uint64         // Router.hepoch when it started
	res     [2][]probeResult
	at      time.Time // when the probes ended
}

// probeResult is one worker's answer to a round's probe.
type probeResult struct {
	err     error
	latency time.Duration
}

// healthRound returns the round /health answers from: the one in flight,
// else the last one when it ended within HealthReuse, probed the servers
// of now and no worker was marked down or re-admitted since it started,
// else a new one, which the caller runs (lead).
func (r *Router) healthRound() (rd *healthRound, lead bool) {
	r.hmu.Lock()
	defer r.hmu.Unlock()
	now, epoch := [2][]*upstream{r.prefill.list(), r.gen.list()}, r.hepoch.Load()
	if rd := r.hlast; rd != nil {
		select {
		case <-rd.done:
			if time.Since(rd.at) < HealthReuse && rd.epoch == epoch && slices.Equal(rd.servers[0], now[0]) && slices.Equal(rd.servers[1], now[1]) {
				return rd, false
			}
		default:
			return rd, false
		}
	}
	r.hlast = &healthRound{done: make(chan struct{}), servers: now, epoch: epoch}
	return r.hlast, true
}

// runHealthRound probes every worker of rd at once, each within
// HealthTimeout (one stalled worker delays no other), and re-admits those
// marked down that answer. The probes belong to the router, not to the caller that runs
// them: they run until they end or the router closes.
func (r *Router) runHealthRound(rd *healthRound) {
	var wg sync.WaitGroup
	for gi, g := range []*group{r.prefill, r.gen} {
		rd.res[gi] = make([]probeResult, len(rd.servers[gi]))
		for i, s := range rd.servers[gi] {
			wg.Go(func() {
				start := time.Now()
				err := r.checkHealth(r.life, s)
				rd.res[gi][i] = probeResult{err: err, latency: time.Since(start)}
				if err == nil {
					r.markUp(g, s)
				}
			})
		}
	}
	wg.Wait()
	rd.at = time.Now()
	close(rd.done)
}

// health answers 200 when at least one context and one generation worker
// answered their /health with 200 in the round it answers from (see
// HealthReuse), else 503; the body lists every worker: healthy, its error,
// and whether the router has it marked down (and why, since when; read at
// the call), and checked_at says when the round ended. A worker marked
// down that answers is re-admitted. A caller that leaves while the round
// runs gets no answer; the round goes on for the others.
func (r *Router) health(w http.ResponseWriter, req *http.Request) {
	type state struct {
		URL        string  `json:"url"`
		Healthy    bool    `json:"healthy"`
		Error      string  `json:"error,omitempty"`
		LatencyMs  float64 `json:"latency_ms"`
		MarkedDown bool    `json:"marked_down"`
		DownReason string  `json:"down_reason,omitempty"`
		DownSince  string  `json:"down_since,omitempty"`
	}
	rd, lead := r.healthRound()
	if lead {
		r.runHealthRound(rd)
	}
	select {
	case <-rd.done:
	case <-req.Context().Done():
		return
	}
	var out [2][]state
	for gi := range rd.servers {
		out[gi] = make([]state, len(rd.servers[gi]))
		for i, s := range rd.servers[gi] {
			res := rd.res[gi][i]
			st := state{URL: s.url, Healthy: res.err == nil, LatencyMs: msOf(res.latency)}
			if res.err != nil {
				st.Error = res.err.Error()
			}
			if down, why, since := s.state(); down {
				st.MarkedDown, st.DownReason, st.DownSince = true, why, since.UTC().Format(time.RFC3339Nano)
			}
			out[gi][i] = st
		}
	}
	anyHealthy := func(ss []state) bool {
		for _, s := range ss {
			if s.Healthy {
				return true
			}
		}
		return false
	}
	code, status := http.StatusOK, "ok"
	if !anyHealthy(out[0]) || !anyHealthy(out[1]) {
		code, status = http.StatusServiceUnavailable, "unavailable"
	}
	body := map[string]any{"status": status, "context_servers": out[0], "generation_servers": out[1], "checked_at": rd.at.UTC().Format(time.RFC3339Nano)}
	if r.cluster != nil {
		ci := r.clusterState()
		body["cluster"] = ci
		if !ci.IsReady {
			code, status = http.StatusServiceUnavailable, "unavailable"
			body["status"] = status
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(body)
}
