package transceiver

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
)

// Options are what New needs beyond the public config: the instance's
// layout and memory, and where to listen.
type Options struct {
	// State is the instance's CacheState (DPRank is taken per request).
	State layout.CacheState
	// Pools holds one pool per rank, in rank order; each must have the
	// rank's block layout (State.RankLayout).
	Pools []*kvcache.Pool
	// ListenHost is the address the control and data listeners bind to;
	// "" means 127.0.0.1.
	ListenHost string
	// DataStreams is the number of parallel data connections per peer for
	// TCP; 0 means the backend's default.
	DataStreams int
	// Host identifies this machine for same-host detection; "" means the
	// hostname and kernel boot id.
	Host string
	// Logger receives the transceiver's logs; nil discards them.
	Logger *slog.Logger
	// Now is the clock for statistics and for the expiry of opaque states;
	// nil means time.Now.
	Now func() time.Time
	// Observer receives transfer events (metrics); nil means none. One
	// that is also a ConnObserver receives the control connections' events.
	Observer Observer

	// Secret is the cluster secret (at least config.MinSecretBytes). With
	// one, the context side signs every opaque state it hands out (expiry
	// and nonce included) and the generation side refuses, before dialling
	// anything, states that are unsigned, forged, expired or replayed.
	// Without one the instance is unauthenticated: it says so once, loudly,
	// and dials only loopback and AllowedPeerHosts.
	Secret []byte
	// AllowedPeerHosts are the hosts (IP addresses, CIDR prefixes, host
	// names; see config.ParsePeerHost) this instance may dial for a
	// transfer and accept control connections from; loopback always. Empty
	// means: dial loopback only without a Secret, anything with one; accept
	// anyone.
	AllowedPeerHosts []string
	// NonceCacheSize bounds the nonces of accepted signed states remembered
	// until their expiry, to refuse replays; 0 means DefaultNonceCacheSize.
	// When it is full, new signed states are refused (ErrReplayCacheFull)
	// until the oldest expire: memory stays bounded and no replay window
	// opens.
	NonceCacheSize int
	// LookupHost resolves the host names of AllowedPeerHosts, once, in
	// New; nil means the system resolver.
	LookupHost func(ctx context.Context, host string) ([]netip.Addr, error)
	// TLS, when non-nil, makes the control connections and the tcp data
	// plane mutual TLS (both configs required; see transport.TLSConfig).
	// It covers TCP only: the shm data plane stays within one host and the
	// ucx one has no TLS.
	TLS *transport.TLSConfig
	// Limits bound the connections each rank accepts (control and data);
	// zero fields take the defaults (see ConnLimits).
	Limits ConnLimits
}

// Transceiver is the KV-cache transceiver of one instance (TP×PP ranks in
// this process). It implements TensorRT-LLM's transceiver API: the context
// side holds finished prefills until the generation side pulls them, the
// generation side pulls into its own blocks, and a request completes only
// when every rank of the instance has completed it.
//
// Methods are safe for concurrent use. Close is idempotent.
type Transceiver struct {
	state      layout.CacheState
	ranks      []*rank
	resolution config.Resolution
	log        *slog.Logger
	now        func() time.Time
	csv        *timingCSV
	timeout    time.Duration // kv_transfer_timeout: the expiry of a signed opaque state
	guard      *opaqueGuard

	mu      sync.Mutex
	closed  bool
	pending map[pendingKey]*pending
	doneCtx []*Request
	doneGen []*Request
	wake    chan struct{} // closed and replaced whenever a request completes
}

type pendingKey struct {
	gen bool
	id  uint64
}

type pending struct {
	req       *Request
	remaining int
	err       error
	stats     Stats
	start     time.Time
	end       time.Time
	silent    bool // failed synchronously: not reported by Check*
}

// New builds the transceiver of one instance from the public config. It is
// the one place where config.CacheTransceiver becomes transport options:
// it resolves the backend (DEFAULT through the TRT-LLM environment
// variables, AUTO per peer), sizes the staging buffers, opens the data
// planes and the control listeners (one per rank). ctx bounds the opening
// only.
func New(ctx context.Context, cfg *config.CacheTransceiver, opts Options) (*Transceiver, error) {
	if cfg == nil || cfg.Backend == config.BackendUnset {
		return nil, fmt.Errorf("%w: %w", ErrNoTransceiver, config.ErrNoTransceiver)
	}
	if opts.TLS != nil && (opts.TLS.Server == nil || opts.TLS.Client == nil) {
		return nil, errors.New("transceiver: Options.TLS needs both a Server and a Client config")
	}
	if err := opts.State.Validate(); err != nil {
		return nil, fmt.Errorf("transceiver: instance state: %w", err)
	}
	tpb := opts.State.Shape.TokensPerBlock
	if err := cfg.Validate(tpb); err != nil {
		return nil, fmt.Errorf("transceiver: config: %w", err)
	}
	nr := opts.State.Parallel.NumRanks()
	if len(opts.Pools) != nr {
		return nil, fmt.Errorf("transceiver: %d pools for %d ranks", len(opts.Pools), nr)
	}
	for i, p := range opts.Pools {
		if p.Layout() != opts.State.RankLayout(i) {
			return nil, fmt.Errorf("transceiver: pool of rank %d has layout %+v, the instance state needs %+v", i, p.Layout(), opts.State.RankLayout(i))
		}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	res := cfg.Resolve(Availability)
	if res.Err != nil {
		return nil, fmt.Errorf("transceiver: %s: %w", res.Reason, res.Err)
	}
	log.Info("cache transceiver backend", "configured", string(res.Configured), "backend", string(res.Backend), "reason", res.Reason)
	for _, ig := range res.Ignored {
		log.Info("environment variable ignored", "detail", ig)
	}
	names := backendsToOpen(res.Backend)
	host := opts.ListenHost
	if host == "" {
		host = "127.0.0.1"
	}
	hostID := opts.Host
	if hostID == "" {
		hostID = HostIdentity()
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	if n := len(opts.Secret); n > 0 && n < config.MinSecretBytes {
		return nil, fmt.Errorf("transceiver: the cluster secret is %d bytes, at least %d are needed", n, config.MinSecretBytes)
	}
	peers, err := newPeerPolicy(ctx, opts.AllowedPeerHosts, len(opts.Secret) > 0, opts.LookupHost, log)
	if err != nil {
		return nil, err
	}
	if len(opts.Secret) == 0 {
		log.Warn("UNAUTHENTICATED: no cluster secret: opaque states are neither signed nor checked, and this instance dials only loopback and allowed peer hosts; "+
			"set security.secret_file or "+config.EnvClusterSecret+" on every worker of the cluster (kvxfer up does it itself)",
			"allowed_peer_hosts", peers.list)
	} else {
		log.Info("opaque states are signed and checked with the cluster secret", "allowed_peer_hosts", peers.list)
	}
	lim := opts.Limits.withDefaults()
	t := &Transceiver{state: opts.State, resolution: res, log: log, now: now, timeout: cfg.Timeout(),
		guard:   newOpaqueGuard(opts.Secret, peers, now, opts.NonceCacheSize),
		pending: map[pendingKey]*pending{}, wake: make(chan struct{})}
	if cfg.TimeOutputPath != "" {
		t.csv = &timingCSV{dir: cfg.TimeOutputPath, files: map[string]*os.File{}}
	}
	for i := range nr {
		bufBytes := cfg.TransferBufferSize
		if cfg.MaxTokensInBuffer > 0 {
			// TRT-LLM: (min(window, T) + tokens_per_block) tokens of this
			// rank's layers and heads, i.e. T/tpb + 1 blocks.
			bufBytes = int64(cfg.MaxTokensInBuffer/tpb+1) * opts.Pools[i].BlockBytes()
		}
		set := rankSettings{
			timeout: cfg.Timeout(), backend: strings.ToLower(string(res.Backend)), bufferBytes: bufBytes,
			sendBuffers: cfg.SendBuffers, recvBuffers: cfg.RecvBuffers, zeroCopy: cfg.ZeroCopy,
			host: hostID, logger: log, now: now, peers: peers, limits: lim,
		}
		if opts.TLS != nil {
			set.tls = opts.TLS.Client
		}
		if co, ok := opts.Observer.(ConnObserver); ok {
			set.conns = connObs{co}
		}
		if set.sendBuffers <= 0 {
			set.sendBuffers = config.DefaultSendBuffers
		}
		if set.recvBuffers <= 0 {
			set.recvBuffers = 1
		}
		trs := map[string]transport.Transport{}
		var openErr error
		for _, name := range names {
			tr, err := transport.Open(ctx, name, transport.Options{ListenAddr: net.JoinHostPort(host, "0"), Streams: opts.DataStreams, Logger: log, TLS: opts.TLS,
				MaxConns: lim.MaxDataConns, MaxConnsPerHost: lim.MaxDataConnsPerHost})
			if err != nil {
				openErr = fmt.Errorf("transceiver: rank %d: open %s: %w", i, name, err)
				break
			}
			trs[name] = tr
		}
		var ln net.Listener
		if openErr == nil {
			var lc net.ListenConfig
			ln, openErr = lc.Listen(ctx, "tcp", net.JoinHostPort(host, "0"))
			if openErr == nil && opts.TLS != nil {
				ln = &tlsListener{Listener: ln, cfg: opts.TLS.Server, log: log}
			}
		}
		if openErr != nil {
			for _, tr := range trs {
				tr.Close()
			}
			t.Close()
			return nil, openErr
		}
		r := newRank(i, opts.State, opts.Pools[i], set, trs, ln, t.rankDone)
		r.obs, r.csv = opts.Observer, t.csv
		if err := r.registerMemory(); err != nil {
			r.close()
			t.Close()
			return nil, err
		}
		t.ranks = append(t.ranks, r)
		r.start()
	}
	return t, nil
}

// backendsToOpen lists the data planes a rank opens for a resolved backend.
func backendsToOpen(b config.Backend) []string {
	if b != config.BackendAuto {
		return []string{strings.ToLower(string(b))}
	}
	var names []string
	for _, n := range []string{"shm", "ucx", "tcp"} {
		if s, err := transport.Lookup(n); err == nil && s.Available() {
			names = append(names, n)
		}
	}
	return names
}

// PoolAllocator returns the allocator the pools of an instance should use
// with this config. Every backend now moves data from and to any memory
// (shm copies through a window of its own and never shares a pool), so it
// is the Go heap; the function stays so that callers need not change when a
// backend wants registered memory again.
func PoolAllocator(cfg *config.CacheTransceiver) kvcache.Allocator {
	return kvcache.HeapAllocator{}
}

// Availability reports whether this binary can run a backend (nil) or why
// not; it answers config.ResolveBackend's question.
func Availability(b config.Backend) error {
	switch b {
	case config.BackendAuto:
		var reasons []string
		for _, s := range transport.All() {
			if s.Available() {
				return nil
			}
			reasons = append(reasons, fmt.Sprintf("%s: %v", s.Name, s.Err))
		}
		return fmt.Errorf("no backend is available in this binary (%s)", strings.Join(reasons, "; "))
	case config.BackendDefault, config.BackendUnset:
		return nil
	}
	s, err := transport.Lookup(string(b))
	if err != nil {
		return err
	}
	return s.Err
}

// HostIdentity names this machine for same-host detection: the hostname and
// the kernel's boot id (two containers with one hostname on different
// machines differ in boot id).
func HostIdentity() string {
	h, _ := os.Hostname()
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		h += "/" + strings.TrimSpace(string(b))
	}
	return h
}

// Resolution returns how the backend was chosen.
func (t *Transceiver) Resolution() config.Resolution { return t.resolution }

// Endpoints returns the control endpoint of every rank, in rank order.
func (t *Transceiver) Endpoints() []string {
	out := make([]string, len(t.ranks))
	for i, r := range t.ranks {
		out[i] = r.endpoint()
	}
	return out
}

// participants returns the ranks that hold a request of DP group dp.
func (t *Transceiver) participants(dp int) ([]*rank, error) {
	pc := t.state.Parallel
	if !pc.AttentionDP {
		if dp != 0 {
			return nil, fmt.Errorf("transceiver: DP rank %d without attention DP", dp)
		}
		return t.ranks, nil
	}
	if dp < 0 || dp >= pc.DPSize {
		return nil, fmt.Errorf("transceiver: DP rank %d out of range (DP size %d)", dp, pc.DPSize)
	}
	var out []*rank
	for _, r := range t.ranks {
		_, _, tp := pc.Coords(r.idx)
		if g, _ := pc.DPGroup(tp); g == dp {
			out = append(out, r)
		}
	}
	return out, nil
}

func (t *Transceiver) requestState(dp int) layout.CacheState {
	s := t.state
	s.Parallel.LayersPerPP = append([]int(nil), s.Parallel.LayersPerPP...)
	s.Parallel.DPRank = dp
	return s
}

// RespondAndSendAsync hands a context_only request whose prefill is done to
// the transceiver: every rank holds the request's blocks (an extra
// reference; the caller may release its own) until the generation instance
// has pulled them or kv_transfer_timeout_ms has passed. It sets
// req.ContextPhase (ctx request id and opaque state) and the state
// DISAGG_CONTEXT_TRANS_IN_PROGRESS, and returns at once.
func (t *Transceiver) RespondAndSendAsync(req *Request) error {
	if req.Type != ContextOnly {
		return fmt.Errorf("transceiver: respond: request %d is %s, want context_only", req.ID, req.Type)
	}
	ranks, err := t.participants(req.DPRank)
	if err != nil {
		return err
	}
	if len(req.Blocks) != len(t.ranks) {
		return fmt.Errorf("transceiver: respond: request %d has blocks for %d ranks, the instance has %d", req.ID, len(req.Blocks), len(t.ranks))
	}
	nb := len(req.Blocks[ranks[0].idx])
	for _, r := range ranks {
		if len(req.Blocks[r.idx]) == 0 || len(req.Blocks[r.idx]) != nb {
			return fmt.Errorf("transceiver: respond: request %d: rank %d has %d blocks, rank %d has %d", req.ID, r.idx, len(req.Blocks[r.idx]), ranks[0].idx, nb)
		}
	}
	var token [16]byte
	rand.Read(token[:])
	state := t.requestState(req.DPRank)
	op := &OpaqueState{RequestID: req.ID, Token: token, Tokens: uint64(max(0, req.NumTokens)), State: state, Endpoints: t.Endpoints()}
	if t.guard.key != nil {
		// The ranks release the blocks timeout after they take them
		// (below): the state is good until then and not after.
		if err := op.sign(t.guard.key, t.now().Add(t.timeout)); err != nil {
			return err
		}
	}
	enc, err := op.MarshalBinary()
	if err != nil {
		return err
	}
	p, err := t.begin(req, false, len(ranks), DisaggContextTransInProgress)
	if err != nil {
		return err
	}
	if req.ContextPhase == nil {
		req.ContextPhase = &ContextPhaseParams{}
	}
	req.ContextPhase.CtxRequestID, req.ContextPhase.OpaqueState = req.ID, enc
	for i, r := range ranks {
		if err := r.respond(req.ID, token, state, req.Blocks[r.idx], req.BlockHashes); err != nil {
			t.abortStart(p, ranks[:i], false, len(ranks)-i, err)
			return err
		}
	}
	return nil
}

// RequestAndReceiveAsync starts pulling a generation_only request's KV cache
// into req.Blocks, from the context instance named by
// req.ContextPhase.OpaqueState. It sets DISAGG_GENERATION_TRANS_IN_PROGRESS
// and returns at once.
func (t *Transceiver) RequestAndReceiveAsync(req *Request) error {
	if req.Type != GenerationOnly {
		return fmt.Errorf("transceiver: receive: request %d is %s, want generation_only", req.ID, req.Type)
	}
	if req.ContextPhase == nil || len(req.ContextPhase.OpaqueState) == 0 {
		return fmt.Errorf("transceiver: receive: request %d has no context phase params (opaque state)", req.ID)
	}
	var op OpaqueState
	if err := op.UnmarshalBinary(req.ContextPhase.OpaqueState); err != nil {
		return fmt.Errorf("transceiver: receive: request %d: %w", req.ID, err)
	}
	// Before anything is dialled: signature, expiry, allowed peers, and
	// the nonce, recorded so that the state is not accepted again.
	if err := t.guard.check(&op, true); err != nil {
		return fmt.Errorf("transceiver: receive: request %d: %w", req.ID, err)
	}
	ranks, err := t.participants(req.DPRank)
	if err != nil {
		return err
	}
	if len(req.Blocks) != len(t.ranks) {
		return fmt.Errorf("transceiver: receive: request %d has blocks for %d ranks, the instance has %d", req.ID, len(req.Blocks), len(t.ranks))
	}
	if req.NumTokens > 0 && op.Tokens > 0 && uint64(req.NumTokens) != op.Tokens {
		return fmt.Errorf("%w: request %d has %d prompt tokens but context request %d holds the KV cache of %d: the prompt does not belong to this context request",
			ErrPromptMismatch, req.ID, req.NumTokens, op.RequestID, op.Tokens)
	}
	genState := t.requestState(req.DPRank)
	if err := layout.Compatible(op.State, genState); err != nil {
		return fmt.Errorf("transceiver: receive: request %d: %w", req.ID, err)
	}
	p, err := t.begin(req, true, len(ranks), DisaggGenerationTransInProgress)
	if err != nil {
		return err
	}
	for i, r := range ranks {
		if err := r.receive(req.ID, &op, genState, req.Blocks[r.idx], req.LastBlockHash); err != nil {
			t.abortStart(p, ranks[:i], true, len(ranks)-i, err)
			return err
		}
	}
	return nil
}

// CheckOpaque decodes an opaque state and checks it as
// RequestAndReceiveAsync does before it dials anything: with a cluster
// secret it must be signed (ErrUnsignedOpaqueState) with this secret
// (ErrForgedOpaqueState) and its nonce not yet accepted
// (ErrReplayedOpaqueState); a signed state must not have expired
// (ErrExpiredOpaqueState); every endpoint's host must be allowed
// (ErrPeerNotAllowed). It records nothing: a server calls it to refuse a
// bad state before it queues the request and allocates blocks for it.
func (t *Transceiver) CheckOpaque(b []byte) (*OpaqueState, error) {
	var op OpaqueState
	if err := op.UnmarshalBinary(b); err != nil {
		return nil, err
	}
	if err := t.guard.check(&op, false); err != nil {
		return nil, err
	}
	return &op, nil
}

// RequestAndReceiveSync is RequestAndReceiveAsync followed by a wait for
// the transfer to end. It returns nil when the state is
// DISAGG_GENERATION_TRANS_COMPLETE; when ctx ends first the transfer is
// cancelled. The request is not reported again by CheckGenTransferStatus.
func (t *Transceiver) RequestAndReceiveSync(ctx context.Context, req *Request) error {
	if err := t.RequestAndReceiveAsync(req); err != nil {
		return err
	}
	req.mu.Lock()
	done := req.done
	req.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		t.Cancel(req)
		<-done
	}
	t.mu.Lock()
	for i, r := range t.doneGen {
		if r == req {
			t.doneGen = append(t.doneGen[:i], t.doneGen[i+1:]...)
			break
		}
	}
	t.mu.Unlock()
	return req.Err()
}

func (t *Transceiver) begin(req *Request, gen bool, n int, st RequestState) (*pending, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, ErrClosed
	}
	k := pendingKey{gen, req.ID}
	if _, dup := t.pending[k]; dup {
		return nil, fmt.Errorf("transceiver: request %d is already in flight", req.ID)
	}
	p := &pending{req: req, remaining: n, start: t.now()}
	t.pending[k] = p
	req.mu.Lock()
	req.state, req.err, req.done = st, nil, make(chan struct{})
	req.mu.Unlock()
	return p, nil
}

// abortStart handles a rank that could not start: the ranks already started
// are cancelled, and the request ends in error without being reported by the
// Check calls (the caller got the error).
func (t *Transceiver) abortStart(p *pending, started []*rank, gen bool, notStarted int, err error) {
	t.mu.Lock()
	p.silent = true
	if p.err == nil {
		p.err = err
	}
	t.mu.Unlock()
	for range notStarted {
		t.finish(p, gen, err, rankStats{})
	}
	for _, r := range started {
		if gen {
			r.cancelGen(p.req.ID, fmt.Errorf("%w: another rank failed to start: %v", ErrCanceled, err))
		} else {
			r.cancelCtx(p.req.ID, fmt.Errorf("%w: another rank failed to start: %v", ErrCanceled, err))
		}
	}
}

// rankDone is called by a rank when its part of a request ends.
func (t *Transceiver) rankDone(r *rank, gen bool, id uint64, err error, st rankStats) {
	t.mu.Lock()
	p := t.pending[pendingKey{gen, id}]
	first := false
	if p != nil && err != nil && p.err == nil {
		p.err, first = err, true
	}
	t.mu.Unlock()
	if p == nil {
		return
	}
	if first {
		// Ranks agree: one rank's failure fails the request on all.
		others, _ := t.participants(p.req.DPRank)
		why := fmt.Errorf("%w: rank %d failed: %v", ErrCanceled, r.idx, err)
		for _, o := range others {
			switch {
			case o == r:
			case gen:
				o.cancelGen(id, why)
			default:
				o.cancelCtx(id, why)
			}
		}
	}
	t.finish(p, gen, err, st)
}

func (t *Transceiver) finish(p *pending, gen bool, err error, st rankStats) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p.stats.Bytes += st.bytes
	p.stats.Chunks += st.chunks
	if st.backend != "" {
		p.stats.Backend = st.backend
	}
	if !st.end.IsZero() && st.end.After(p.end) {
		p.end = st.end
	}
	p.remaining--
	if p.remaining > 0 {
		return
	}
	delete(t.pending, pendingKey{gen, p.req.ID})
	if p.end.IsZero() {
		p.end = t.now()
	}
	p.stats.Duration = p.end.Sub(p.start)
	req := p.req
	req.mu.Lock()
	req.stats = p.stats
	switch {
	case p.err != nil:
		req.state, req.err = DisaggTransError, p.err
	case gen:
		req.state = DisaggGenerationTransComplete
	default:
		req.state = DisaggContextComplete
	}
	close(req.done)
	req.mu.Unlock()
	if !p.silent {
		if gen {
			t.doneGen = append(t.doneGen, req)
		} else {
			t.doneCtx = append(t.doneCtx, req)
		}
	}
	close(t.wake)
	t.wake = make(chan struct{})
}

// CheckContextTransferStatus returns the context requests whose transfers
// have ended since the last call (state DISAGG_CONTEXT_COMPLETE or
// DISAGG_TRANS_ERROR). It waits until at least atLeast have ended, or until
// none is pending; atLeast < 0 waits for every pending one. ctx bounds the
// wait; every transfer has its own deadline, so the wait always ends.
func (t *Transceiver) CheckContextTransferStatus(ctx context.Context, atLeast int) ([]*Request, error) {
	return t.check(ctx, false, atLeast)
}

// CheckGenTransferStatus is CheckContextTransferStatus for receives (state
// DISAGG_GENERATION_TRANS_COMPLETE or DISAGG_TRANS_ERROR).
func (t *Transceiver) CheckGenTransferStatus(ctx context.Context, atLeast int) ([]*Request, error) {
	return t.check(ctx, true, atLeast)
}

func (t *Transceiver) check(ctx context.Context, gen bool, atLeast int) ([]*Request, error) {
	for {
		t.mu.Lock()
		list := &t.doneCtx
		if gen {
			list = &t.doneGen
		}
		n := 0
		for k, p := range t.pending {
			if k.gen == gen && !p.silent {
				n++
			}
		}
		if n == 0 || (atLeast >= 0 && len(*list) >= atLeast) {
			out := *list
			*list = nil
			t.mu.Unlock()
			return out, nil
		}
		wake := t.wake
		t.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// GenTransferComplete reports whether no receive is pending.
func (t *Transceiver) GenTransferComplete() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.pending {
		if k.gen {
			return false
		}
	}
	return true
}

// Cancel cancels the request's transfer on every rank, on whichever side it
// is; the peers get an abort. It reports whether a transfer was cancelled
// (false when there was none in flight or it had already ended). The
// request then ends in DISAGG_TRANS_ERROR with an error wrapping
// ErrCanceled.
func (t *Transceiver) Cancel(req *Request) bool {
	t.mu.Lock()
	_, ctxPending := t.pending[pendingKey{false, req.ID}]
	_, genPending := t.pending[pendingKey{true, req.ID}]
	t.mu.Unlock()
	ranks, err := t.participants(req.DPRank)
	if err != nil {
		return false
	}
	why := fmt.Errorf("%w: request %d cancelled", ErrCanceled, req.ID)
	any := false
	for _, r := range ranks {
		if ctxPending && r.cancelCtx(req.ID, why) {
			any = true
		}
		if genPending && r.cancelGen(req.ID, why) {
			any = true
		}
	}
	return any
}

// Close fails every transfer in flight, stops every rank and waits for
// their goroutines. Idempotent.
func (t *Transceiver) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	t.mu.Unlock()
	var errs []error
	for _, r := range t.ranks {
		if err := r.close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	if err := t.csv.close(); err != nil {
		errs = append(errs, fmt.Errorf("transceiver: timing files: %w", err))
	}
	return errors.Join(errs...)
}

// PendingContext returns the number of context requests still held.
func (t *Transceiver) PendingContext() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for k := range t.pending {
		if !k.gen {
			n++
		}
	}
	return n
}

// StagingBytesInUse returns the bytes of staging buffers currently taken by
// transfers, over all ranks (role "send" or "recv").
func (t *Transceiver) StagingBytesInUse() (send, recv int64) {
	for _, r := range t.ranks {
		send += r.sendBufs.inUse.Load() * int64(r.sendBufs.size)
		recv += r.recvBufs.inUse.Load() * int64(r.recvBufs.size)
	}
	return send, recv
}

// ControlConnections returns the number of open control connections of all
// ranks (dialled and accepted).
func (t *Transceiver) ControlConnections() int {
	n := 0
	for _, r := range t.ranks {
		r.mu.Lock()
		n += len(r.conns)
		r.mu.Unlock()
	}
	return n
}
