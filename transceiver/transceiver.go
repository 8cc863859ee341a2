package transceiver

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transport"
)

// Options are what New needs beyond the public config: the instance's
// layout and memory, and where to listen.
type Options struct {
	// State is the instance's CacheState (DPRank is taken per request).
	State layout.CacheState
	// Pools holds one pool per rank this process hosts, in the order of
	// Ranks; each must have the rank's block layout (State.RankLayout).
	Pools []*kvcache.Pool
	// Ranks are the ranks of the instance this process hosts, ascending;
	// nil means all of them (one process hosts the instance). Pools[i] is
	// the pool of Ranks[i], and a Request's Blocks[i] are the blocks of
	// Ranks[i]. When they are not the whole instance, Group is required.
	Ranks []int
	// Group is how this process agrees with the other processes hosting
	// ranks of the instance (see CoordinatedGroup and GatherGroup); it is
	// required when Ranks is not the whole instance and refused when it
	// is. The Transceiver closes it.
	Group Group
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
	// WrapDataPlane, when non-nil, wraps every data plane a rank opens
	// (its name is the registry's, "tcp"); what it returns carries the
	// rank's data. For fault injection (transport/faultinject, the chaos
	// suite); nil leaves the data planes as opened.
	WrapDataPlane func(name string, t transport.Transport) transport.Transport

	// network, when set, is where the ranks listen, dial and open their
	// data planes (tests: an in-memory one, whose waits a testing/synctest
	// bubble sees as durably blocked, so that deadlines pass on its fake
	// clock); nil means the machine's.
	network network
}

// Transceiver is the KV-cache transceiver of one instance: of its TP×PP
// ranks, those this process hosts (Options.Ranks; all by default). It
// implements TensorRT-LLM's transceiver API: the context
// side holds finished prefills until the generation side pulls them, the
// generation side pulls into its own blocks, and a request completes only
// when every rank of the instance has completed it.
//
// Methods are safe for concurrent use. Close is idempotent.
type Transceiver struct {
	state      layout.CacheState
	ranks      []*rank       // the ranks this process hosts, ascending
	pos        map[int]int   // position in ranks (and in a Request's Blocks) of each rank hosted here
	group      Group         // nil: every rank is here
	joinedCh   chan struct{} // closed once the group has joined (at once without a group)
	info       *groupInfo    // with a group, once joined: every endpoint, the instance secret
	applyMu    sync.Mutex    // with a group: serialises applying the log and starting requests here
	resolution config.Resolution
	log        *slog.Logger
	now        func() time.Time
	csv        *timingCSV
	timeout    time.Duration // kv_transfer_timeout: the expiry of a signed opaque state
	guard      *opaqueGuard
	plans      *planMemo    // the ranks' too
	parts      map[int]part // takingPart of each DP group, worked out in New

	mu       sync.Mutex
	closed   bool
	inst     *consensus           // the requests in flight, as the ranks agree on them
	reqs     map[instKey]*Request // the requests in flight
	doneSend []*Request           // ended, not yet returned by CheckContextTransferStatus
	doneRecv []*Request           // ended, not yet returned by CheckGenTransferStatus
	wake     chan struct{}        // closed and replaced whenever a request completes
	pulls    uint64               // the last pull id handed out (see pullID)
	nonces   map[instKey][16]byte // the nonce of the signed state of each pull in flight
	silent   map[instKey]bool     // requests whose start failed here: the Check calls do not report them
	// With a group: requests the instance ended before this process
	// began them (see endedUnbegun); begin refuses them for
	// kv_transfer_timeout after.
	unbegun  map[instKey]unbegunEnd
	groupErr error     // with a group: why this process lost it
	lostEv   instEvent // with a group, once lost: the event that fails the ranks hosted elsewhere
}

// pullID returns the id of a new pull (wire GenRequestID), never 0. The
// ids of an instance count up from a random start, so that the pulls of
// two generation instances, which a context request's attempts may come
// from, are not taken for one another.
func (t *Transceiver) pullID() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	for t.pulls == 0 {
		var b [8]byte
		rand.Read(b[:])
		t.pulls = binary.LittleEndian.Uint64(b[:])
	}
	t.pulls++
	if t.pulls == 0 {
		t.pulls++
	}
	return t.pulls
}

// New builds the transceiver of one instance from the public config. It is
// the one place where config.CacheTransceiver becomes transport options:
// it resolves the backend (DEFAULT through the TRT-LLM environment
// variables, AUTO per peer), sizes the staging buffers, opens the data
// planes and the control listeners (one per rank). ctx bounds the opening
// only.
func New(ctx context.Context, cfg *config.CacheTransceiver, opts Options) (*Transceiver, error) {
	if err := checkOptions(cfg, &opts); err != nil {
		return nil, err
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
	peers, err := peerPolicyOf(ctx, &opts, log)
	if err != nil {
		return nil, err
	}
	set := settingsOf(cfg, &opts, res.Backend, peers, log)
	t := &Transceiver{state: opts.State, resolution: res, log: log, now: set.now, timeout: cfg.Timeout(), plans: set.plans,
		guard: newOpaqueGuard(opts.Secret, peers, set.now, opts.NonceCacheSize),
		inst:  newConsensus(), reqs: map[instKey]*Request{}, wake: make(chan struct{}), nonces: map[instKey][16]byte{},
		silent: map[instKey]bool{}, unbegun: map[instKey]unbegunEnd{}, pos: map[int]int{}, joinedCh: make(chan struct{})}
	if cfg.TimeOutputPath != "" {
		t.csv = &timingCSV{dir: cfg.TimeOutputPath, files: map[string]*os.File{}}
	}
	for i, idx := range opts.Ranks {
		r, err := t.openRank(ctx, idx, i, cfg, &opts, set, backendsToOpen(res.Backend))
		if err != nil {
			t.Close()
			return nil, err
		}
		t.ranks = append(t.ranks, r)
		t.pos[idx] = i
		r.ctrl.Start()
	}
	t.parts = map[int]part{}
	for dp := range max(1, t.state.Parallel.DPSize) {
		if all, here, err := t.workOutPart(dp); err == nil {
			t.parts[dp] = part{all, here}
		}
	}
	if opts.Group == nil {
		close(t.joinedCh)
		return t, nil
	}
	t.group = opts.Group
	if cg, ok := opts.Group.(*CoordinatedGroup); ok {
		cg.inherit(opts.Secret, opts.TLS, opts.network)
	}
	self := groupJoin{ranks: slices.Clone(opts.Ranks), endpoints: t.localEndpoints()}
	rand.Read(self.share[:])
	if err := t.group.start(ctx, t, self); err != nil {
		t.Close()
		return nil, err
	}
	return t, nil
}

// checkOptions checks the config and the options before anything opens.
func checkOptions(cfg *config.CacheTransceiver, opts *Options) error {
	if cfg == nil || cfg.Backend == config.BackendUnset {
		return fmt.Errorf("%w: %w", ErrNoTransceiver, config.ErrNoTransceiver)
	}
	if opts.TLS != nil && (opts.TLS.Server == nil || opts.TLS.Client == nil) {
		return errors.New("transceiver: Options.TLS needs both a Server and a Client config")
	}
	if err := opts.State.Validate(); err != nil {
		return fmt.Errorf("transceiver: instance state: %w", err)
	}
	if err := cfg.Validate(opts.State.Shape.TokensPerBlock); err != nil {
		return fmt.Errorf("transceiver: config: %w", err)
	}
	nr := opts.State.Parallel.NumRanks()
	if opts.Ranks == nil {
		opts.Ranks = make([]int, nr)
		for i := range opts.Ranks {
			opts.Ranks[i] = i
		}
	} else {
		opts.Ranks = slices.Clone(opts.Ranks)
	}
	if len(opts.Ranks) == 0 {
		return errors.New("transceiver: Options.Ranks is empty: a process hosts at least one rank")
	}
	for i, r := range opts.Ranks {
		if r < 0 || r >= nr {
			return fmt.Errorf("transceiver: Options.Ranks[%d] is rank %d, the instance has ranks 0..%d", i, r, nr-1)
		}
		if i > 0 && r <= opts.Ranks[i-1] {
			return fmt.Errorf("transceiver: Options.Ranks must be ascending without repeats: %s", intsString(opts.Ranks))
		}
	}
	whole := len(opts.Ranks) == nr
	switch {
	case !whole && opts.Group == nil:
		return fmt.Errorf("transceiver: this process hosts ranks %s of %d: Options.Group is required to agree with the processes hosting the others", intsString(opts.Ranks), nr)
	case whole && opts.Group != nil:
		return fmt.Errorf("transceiver: this process hosts every rank of the instance: Options.Group is for an instance split over processes, leave it nil")
	}
	if len(opts.Pools) != len(opts.Ranks) {
		return fmt.Errorf("transceiver: %d pools for %d ranks hosted here (%s)", len(opts.Pools), len(opts.Ranks), intsString(opts.Ranks))
	}
	for i, p := range opts.Pools {
		if p.Layout() != opts.State.RankLayout(opts.Ranks[i]) {
			return fmt.Errorf("transceiver: pool of rank %d has layout %+v, the instance state needs %+v", opts.Ranks[i], p.Layout(), opts.State.RankLayout(opts.Ranks[i]))
		}
	}
	return nil
}

// peerPolicyOf checks the cluster secret and builds the policy of which
// peers the ranks may dial and accept, saying loudly when the instance is
// unauthenticated.
func peerPolicyOf(ctx context.Context, opts *Options, log *slog.Logger) (*peerPolicy, error) {
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
	return peers, nil
}

// rankSettings are the per-rank settings derived from the public config by
// New (the only place that reads it).
type rankSettings struct {
	timeout     time.Duration
	backend     string // "tcp", "shm", "ucx" or "auto"
	bufferBytes int64  // staging buffer size, before rounding up to a block
	sendBuffers int
	recvBuffers int
	direct      bool // direct transfers allowed (zero_copy)
	host        string
	logger      *slog.Logger
	now         func() time.Time // for statistics
	net         network          // where ranks listen, dial and open data planes
	peers       *peerPolicy      // hosts this rank may dial and accept
	limits      ConnLimits       // with defaults
	plans       *planMemo        // the instance's: layout results once per peer state
	// control is the control plane's configuration that every rank
	// shares: limits, observer, dial, TLS (nil: plain TCP), dial check.
	control control.Config

	// senderTimeout is kv_transfer_sender_future_timeout: how long a
	// context rank's sends may take once they start (0: no bound of
	// their own).
	senderTimeout time.Duration
	// ucxInterface is TRTLLM_UCX_INTERFACE, for a UCX or AUTO backend: the
	// network interface the ucx data plane binds ("": the listen host's).
	ucxInterface string
}

// settingsOf derives the settings every rank shares from the config and
// the options; openRank sizes the staging buffers per rank.
func settingsOf(cfg *config.CacheTransceiver, opts *Options, backend config.Backend, peers *peerPolicy, log *slog.Logger) rankSettings {
	set := rankSettings{
		timeout: cfg.Timeout(), senderTimeout: cfg.SenderTimeout(), backend: backend.Lower(), bufferBytes: cfg.TransferBufferSize,
		sendBuffers: cfg.SendBuffers, recvBuffers: cfg.RecvBuffers, direct: cfg.ZeroCopy,
		host: opts.Host, logger: log, now: opts.Now, net: opts.network, peers: peers, limits: opts.Limits.withDefaults(),
		plans: newPlanMemo(),
	}
	if backend == config.BackendUCX || backend == config.BackendAuto {
		set.ucxInterface = cfg.UCXInterface
	}
	if set.host == "" {
		set.host = HostIdentity()
	}
	if set.net == nil {
		set.net = hostNetwork{}
	}
	if set.now == nil {
		set.now = time.Now
	}
	l := set.limits
	set.control = control.Config{
		Limits: control.Limits{MaxConns: l.MaxControlConns, MaxConnsPerHost: l.MaxControlConnsPerHost, HandshakeTimeout: l.HandshakeTimeout, IdleTimeout: l.IdleTimeout},
		Dial:   set.net.Dial,
		// RequestAndReceiveAsync has checked every endpoint already; the
		// dial is the one place that dials, so the rule is enforced there
		// too.
		DialCheck: peers.endpointCheck,
	}
	if opts.TLS != nil {
		set.control.TLSClient, set.control.TLSServer = opts.TLS.Client, opts.TLS.Server
	}
	if co, ok := opts.Observer.(ConnObserver); ok {
		set.control.Observer = connObs{co}
	}
	if set.sendBuffers <= 0 {
		set.sendBuffers = config.DefaultSendBuffers
	}
	if set.recvBuffers <= 0 {
		set.recvBuffers = 1
	}
	return set
}

// openRank opens rank i (the pool at position at of Options.Pools): its
// data planes (names), its control listener and its staging buffers.
func (t *Transceiver) openRank(ctx context.Context, i, at int, cfg *config.CacheTransceiver, opts *Options, set rankSettings, names []string) (*rank, error) {
	if cfg.MaxTokensInBuffer > 0 {
		// TRT-LLM: (min(window, T) + tokens_per_block) tokens of this
		// rank's layers and heads, i.e. T/tpb + 1 blocks.
		set.bufferBytes = int64(cfg.MaxTokensInBuffer/opts.State.Shape.TokensPerBlock+1) * opts.Pools[at].BlockBytes()
	}
	host := opts.ListenHost
	if host == "" {
		host = "127.0.0.1"
	}
	trs := map[string]transport.Transport{}
	closeAll := func() {
		for _, tr := range trs {
			tr.Close()
		}
	}
	for _, name := range names {
		o := transport.Options{ListenAddr: net.JoinHostPort(host, "0"), Streams: opts.DataStreams, Logger: set.logger, TLS: opts.TLS,
			MaxConns: set.limits.MaxDataConns, MaxConnsPerHost: set.limits.MaxDataConnsPerHost, IdleTimeout: set.limits.IdleTimeout}
		if name == "ucx" {
			o.Interface = set.ucxInterface
		}
		tr, err := set.net.OpenData(ctx, name, o)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("transceiver: rank %d: open %s: %w", i, name, err)
		}
		if opts.WrapDataPlane != nil {
			tr = opts.WrapDataPlane(name, tr)
		}
		trs[name] = tr
	}
	ln, err := set.net.Listen(ctx, host)
	if err != nil {
		closeAll()
		return nil, err
	}
	r := newRank(i, opts.State, opts.Pools[at], set, trs, ln, t.rankDone, t.attemptEnded)
	r.obs, r.csv = opts.Observer, t.csv
	if opts.Group != nil {
		// The ranks' processes are handed a request each at its own time:
		// an ask may come before this one is (see askHold).
		r.begun = t.begunElsewhere
	}
	if err := registerPool(i, opts.Pools[at], trs); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// registerPool declares rank i's pool arena to every data plane that
// wants memory registered. Staging buffers stay private heap memory: no
// backend hands a peer a pool or a staging buffer (shm copies each part
// into a window of the connection; see transport/shm).
func registerPool(i int, pool *kvcache.Pool, trs map[string]transport.Transport) error {
	arena := pool.Arena()
	var f *os.File
	if sa, ok := arena.(*kvcache.ShmArena); ok {
		f = sa.File()
	}
	for _, n := range slices.Sorted(maps.Keys(trs)) {
		if mr, ok := trs[n].(transport.MemoryRegistrar); ok {
			if err := mr.RegisterMemory(arena.Bytes(), f); err != nil {
				return fmt.Errorf("transceiver: rank %d: register the pool with %s: %w", i, n, err)
			}
		}
	}
	return nil
}

// autoOrder is config.AutoPreference as data-plane names: the order in
// which AUTO opens data planes and picks one per peer.
func autoOrder() []string {
	out := make([]string, len(config.AutoPreference))
	for i, b := range config.AutoPreference {
		out[i] = b.Lower()
	}
	return out
}

// backendsToOpen lists the data planes a rank opens for a resolved backend.
func backendsToOpen(b config.Backend) []string {
	if b != config.BackendAuto {
		return []string{b.Lower()}
	}
	var names []string
	for _, n := range autoOrder() {
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

// Endpoints returns the control endpoint of every rank of the instance, in
// rank order. With a Group, until it has joined, the ranks hosted by other
// processes have "".
func (t *Transceiver) Endpoints() []string {
	if t.group != nil {
		select {
		case <-t.joinedCh:
			return slices.Clone(t.info.endpoints)
		default:
		}
		out := make([]string, t.state.Parallel.NumRanks())
		for _, r := range t.ranks {
			out[r.idx] = r.ctrl.Endpoint()
		}
		return out
	}
	return t.localEndpoints()
}

// localEndpoints returns the control endpoints of the ranks hosted here.
func (t *Transceiver) localEndpoints() []string {
	out := make([]string, len(t.ranks))
	for i, r := range t.ranks {
		out[i] = r.ctrl.Endpoint()
	}
	return out
}

// Ranks returns the ranks of the instance this process hosts, ascending.
func (t *Transceiver) Ranks() []int {
	out := make([]int, len(t.ranks))
	for i, r := range t.ranks {
		out[i] = r.idx
	}
	return out
}

// Joined is closed once the instance's group has joined (at once without a
// Group): from then on the Transceiver takes requests. A GatherGroup joins
// at the first round that every process takes part in.
func (t *Transceiver) Joined() <-chan struct{} { return t.joinedCh }

// ready says whether requests may start: the group has joined and is not
// lost.
func (t *Transceiver) ready() error {
	t.mu.Lock()
	err := t.groupErr // a group lost before its join, too
	t.mu.Unlock()
	if err != nil {
		return err
	}
	select {
	case <-t.joinedCh:
		return nil
	default:
		return ErrNotJoined
	}
}

// participants returns the ranks hosted here that hold a request of DP
// group dp.
func (t *Transceiver) participants(dp int) ([]*rank, error) {
	_, here, err := t.takingPart(dp)
	return here, err
}

// takingPart returns the ranks of the instance that hold a request of DP
// group dp, and of them those hosted here.
func (t *Transceiver) takingPart(dp int) (all []int, here []*rank, err error) {
	if p, ok := t.parts[dp]; ok {
		return p.all, p.here, nil
	}
	return t.workOutPart(dp)
}

// part is what takingPart returns for a DP group (shared: read-only).
type part struct {
	all  []int
	here []*rank
}

// workOutPart is takingPart, worked out.
func (t *Transceiver) workOutPart(dp int) (all []int, here []*rank, err error) {
	pc := t.state.Parallel
	if pc.AttentionDP && (dp < 0 || dp >= pc.DPSize) {
		return nil, nil, invalidRequest("transceiver: DP rank %d out of range (DP size %d)", dp, pc.DPSize)
	}
	if !pc.AttentionDP && dp != 0 {
		return nil, nil, invalidRequest("transceiver: DP rank %d without attention DP", dp)
	}
	for i := range pc.NumRanks() {
		if pc.AttentionDP {
			_, _, tp := pc.Coords(i)
			if g, _ := pc.DPGroup(tp); g != dp {
				continue
			}
		}
		all = append(all, i)
		if at, ok := t.pos[i]; ok {
			here = append(here, t.ranks[at])
		}
	}
	if len(here) == 0 {
		return nil, nil, invalidRequest("transceiver: no rank of DP group %d is hosted by this process (ranks %s)", dp, intsString(t.Ranks()))
	}
	return all, here, nil
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
// has pulled them or kv_transfer_timeout_ms has passed. A pull that fails
// for a reason of the generation side or the link fails that generation
// request only: the request stays held for its owner to pull again with the
// same context phase params, up to maxPullAttempts failed pulls (see the
// package docs, "Failed pulls and retries"). It sets req.ContextPhase
// (ctx_request_id and opaque state) and the state
// DISAGG_CONTEXT_TRANS_IN_PROGRESS, and returns at once.
func (t *Transceiver) RespondAndSendAsync(req *Request) error {
	if req.Type != ContextOnly {
		return invalidRequest("transceiver: respond: request %d is %s, want context_only", req.ID, req.Type)
	}
	if err := t.ready(); err != nil {
		return fmt.Errorf("transceiver: respond: request %d: %w", req.ID, err)
	}
	all, ranks, err := t.takingPart(req.DPRank)
	if err != nil {
		return err
	}
	if len(req.Blocks) != len(t.ranks) {
		return invalidRequest("transceiver: respond: request %d has blocks for %d ranks, this process hosts %d", req.ID, len(req.Blocks), len(t.ranks))
	}
	nb := len(req.Blocks[t.pos[ranks[0].idx]])
	for _, r := range ranks {
		switch n := len(req.Blocks[t.pos[r.idx]]); {
		case n == 0:
			return invalidRequest("transceiver: respond: request %d: rank %d has no blocks", req.ID, r.idx)
		case n != nb:
			return invalidRequest("transceiver: respond: request %d: rank %d has %d blocks, rank %d has %d", req.ID, r.idx, n, ranks[0].idx, nb)
		}
	}
	var token [16]byte
	if t.group != nil {
		// The same on every process of the instance, with no message.
		token = deriveToken(t.info.secret, req.ID, uint64(max(0, req.NumTokens)))
	} else {
		rand.Read(token[:])
	}
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
	if req.ContextPhase == nil {
		req.ContextPhase = &ContextPhaseParams{}
	}
	req.ContextPhase.CtxRequestID, req.ContextPhase.OpaqueState = req.ID, enc
	return t.start(req, sideSend, all, ranks, DisaggContextTransInProgress, func(r *rank) error {
		return r.respond(req.ID, token, state, req.Blocks[t.pos[r.idx]], req.BlockHashes, req.PromptDigest)
	})
}

// start enters req, which the instance's ranks all take part in, in the
// consensus and starts it on the ranks hosted here (here). With a group,
// the process's begin goes to the log before its ranks' reports, and the
// log is not applied meanwhile, so that a decision of the instance taken
// before this process began (another process's rank failed) reaches
// these ranks once they hold the request.
func (t *Transceiver) start(req *Request, s side, all []int, here []*rank, st RequestState, run func(*rank) error) error {
	if t.group != nil {
		t.applyMu.Lock()
		defer t.applyMu.Unlock()
	}
	key, err := t.begin(req, s, all, st)
	if err != nil {
		return err
	}
	for i, r := range here {
		if err := run(r); err != nil {
			t.startFailed(key, here[i:], err)
			return err
		}
	}
	if t.group != nil {
		// Decided already on the log as applied here: carry it out now.
		t.mu.Lock()
		var effs []instEffect
		if ir := t.inst.reqs[key]; ir != nil && ir.err != nil {
			effs = t.inst.cancelOthers(key, ir, -1, fmt.Errorf("%w: another rank failed: %v", ErrCanceled, ir.err))
		}
		t.mu.Unlock()
		t.cancelRanks(effs)
	}
	return nil
}

// RequestAndReceiveAsync starts pulling a generation_only request's KV cache
// into req.Blocks, from the context instance named by
// req.ContextPhase.OpaqueState. It sets DISAGG_GENERATION_TRANS_IN_PROGRESS
// and returns at once. When the pull fails, only req fails: the context
// request stays pullable (unless the failure was the context side's), and
// a new generation request with the same context phase params may pull it
// again. With a cluster secret, a signed state accepted by this instance is
// refused here afterwards (ErrReplayedOpaqueState) once a pull of it has
// completed or been refused by the context instance; a pull that failed
// otherwise gives it back, and so does an error returned here.
func (t *Transceiver) RequestAndReceiveAsync(req *Request) error {
	if req.Type != GenerationOnly {
		return invalidRequest("transceiver: receive: request %d is %s, want generation_only", req.ID, req.Type)
	}
	if req.ContextPhase == nil || len(req.ContextPhase.OpaqueState) == 0 {
		return invalidRequest("transceiver: receive: request %d has no context phase params (opaque state)", req.ID)
	}
	if err := t.ready(); err != nil {
		return fmt.Errorf("transceiver: receive: request %d: %w", req.ID, err)
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
	// Refused below for the caller's own mistake, before its pull began,
	// the state keeps no nonce: its owner may correct the request. Once
	// the pull has the nonce (t.nonces), its end decides.
	handed := false
	defer func() {
		if !handed && op.Signed && t.guard.key != nil {
			t.guard.giveBack(op.Nonce)
		}
	}()
	all, ranks, err := t.takingPart(req.DPRank)
	if err != nil {
		return err
	}
	if len(req.Blocks) != len(t.ranks) {
		return invalidRequest("transceiver: receive: request %d has blocks for %d ranks, this process hosts %d", req.ID, len(req.Blocks), len(t.ranks))
	}
	if req.NumTokens > 0 && op.Tokens > 0 && uint64(req.NumTokens) != op.Tokens {
		return fmt.Errorf("%w: request %d has %d prompt tokens but context request %d holds the KV cache of %d: the prompt does not belong to this context request",
			ErrPromptMismatch, req.ID, req.NumTokens, op.RequestID, op.Tokens)
	}
	genState := t.requestState(req.DPRank)
	if err := t.plans.compatible(op.State, genState); err != nil {
		return fmt.Errorf("transceiver: receive: request %d: %w", req.ID, err)
	}
	// One id for the pull on every rank: the context ranks tell the
	// attempts of a context request apart by it.
	var id uint64
	if t.group != nil {
		id = derivePullID(t.info.secret, req.ID, req.ContextPhase.OpaqueState)
	} else {
		id = t.pullID()
	}
	key := instKey{sideRecv, req.ID}
	return t.start(req, sideRecv, all, ranks, DisaggGenerationTransInProgress, func(r *rank) error {
		if r == ranks[0] && op.Signed && t.guard.key != nil {
			t.mu.Lock()
			t.nonces[key] = op.Nonce
			t.mu.Unlock()
			handed = true
		}
		return r.receive(id, req.ID, &op, genState, req.Blocks[t.pos[r.idx]], req.LastBlockHash, req.PromptDigest)
	})
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
	if i := slices.Index(t.doneRecv, req); i >= 0 {
		t.doneRecv = slices.Delete(t.doneRecv, i, i+1)
	}
	t.mu.Unlock()
	return req.Err()
}

// begin enters req, which the instance's ranks take part in, in the
// consensus: in this process's copy of it at once, or (with a group) in
// every process's through the log.
func (t *Transceiver) begin(req *Request, s side, ranks []int, st RequestState) (instKey, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	key := instKey{s, req.ID}
	if t.closed {
		return key, ErrClosed
	}
	if t.group != nil {
		if t.groupErr != nil {
			return key, t.groupErr
		}
		if _, dup := t.reqs[key]; dup {
			return key, invalidRequest("transceiver: request %d is already in flight", key.id)
		}
		if u, ok := t.unbegun[key]; ok && t.now().Sub(u.at) < t.timeout {
			return key, fmt.Errorf("%w: request %d already ended on the instance before this process was handed it: %v", ErrCanceled, key.id, u.cause)
		}
		t.group.publish(joinBeginEvent{key: key, ranks: slices.Clone(ranks), now: t.now()})
	} else if err := t.inst.begin(key, ranks, t.now()); err != nil {
		return key, err
	}
	delete(t.silent, key)
	t.reqs[key] = req
	req.mu.Lock()
	req.state, req.err, req.done = st, nil, make(chan struct{})
	req.mu.Unlock()
	return key, nil
}

// startFailed handles ranks that could not start (the first with err):
// the ranks already started are cancelled, and the request ends in error
// without being reported by the Check calls (the caller got the error).
func (t *Transceiver) startFailed(key instKey, ranks []*rank, err error) {
	idx := make([]int, len(ranks))
	for i, r := range ranks {
		idx[i] = r.idx
	}
	t.mu.Lock()
	t.silent[key] = true
	t.mu.Unlock()
	t.report(startFailedEvent{key: key, ranks: idx, err: err, now: t.now()})
}

// begunElsewhere tells a rank whether the consensus, as applied in this
// process, shows context request id begun on the instance and not over for
// rank (a rank's begunFunc). Called with the rank's lock held.
func (t *Transceiver) begunElsewhere(id uint64, rank int) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed || t.groupErr != nil {
		return time.Time{}, false
	}
	return t.inst.begunElsewhere(id, rank)
}

// rankDone is called by a rank when its part of a request ends.
func (t *Transceiver) rankDone(rank int, key instKey, err error, res rankResult) {
	t.report(rankDoneEvent{key: key, rank: rank, err: err, res: res, now: t.now()})
}

// attemptEnded is called by a rank when its part of a pull attempt of a
// context request ends.
func (t *Transceiver) attemptEnded(rank int, key instKey, attempt uint64, err error) {
	t.report(attemptEndEvent{key: key, rank: rank, attempt: attempt, err: err})
}

// report feeds an event of this process to the consensus: at once without
// a group, through the group's log with one.
func (t *Transceiver) report(ev instEvent) {
	if t.group != nil {
		t.group.publish(ev)
		return
	}
	t.cancelRanks(t.step(ev))
}

// joined takes the group's join (groupMember).
func (t *Transceiver) joined(all []groupJoin) error {
	info, err := joinGroup(all, t.state.Parallel.NumRanks())
	if err != nil {
		return err
	}
	for _, r := range t.ranks {
		if info.endpoints[r.idx] != r.ctrl.Endpoint() {
			return fmt.Errorf("%w: the join lists %q for rank %d, hosted here at %s", ErrBadGroup, info.endpoints[r.idx], r.idx, r.ctrl.Endpoint())
		}
	}
	t.info = info
	close(t.joinedCh)
	return nil
}

// apply applies a piece of the instance's log (groupMember).
func (t *Transceiver) apply(evs []instEvent) {
	t.applyMu.Lock()
	defer t.applyMu.Unlock()
	for _, ev := range evs {
		t.cancelRanks(t.step(ev))
		if _, ok := ev.(joinBeginEvent); ok {
			t.mu.Lock()
			lostEv := t.lostEv
			t.mu.Unlock()
			if lostEv != nil {
				// Begun after the group was lost (the begin was this
				// process's, on its way to the others): the other
				// ranks are lost to it too.
				t.cancelRanks(t.step(lostEv))
			}
		}
	}
}

// lost records that this process has lost the group (groupMember), and
// returns the event that fails every rank hosted elsewhere.
func (t *Transceiver) lost(err error) instEvent {
	var others []int
	for i := range t.state.Parallel.NumRanks() {
		if _, ok := t.pos[i]; !ok {
			others = append(others, i)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.groupErr == nil {
		t.groupErr = err
		t.lostEv = ranksLostEvent{ranks: others, err: err, now: t.now()}
	}
	return t.lostEv
}

// step feeds ev to the consensus core. It completes the requests the core
// completes at once, under the lock (so that the Check calls never see a
// request neither pending nor done), and returns the other effects (for
// ranks) to carry out.
func (t *Transceiver) step(ev instEvent) []instEffect {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []instEffect
	for _, e := range t.inst.step(ev) {
		if c, ok := e.(instCompleteEffect); ok {
			t.completeLocked(c)
		} else {
			out = append(out, e)
		}
	}
	return out
}

// cancelRanks carries out the consensus' effects for ranks: cancels, and
// the fate of pull attempts. It reports whether any rank had something to
// cancel.
func (t *Transceiver) cancelRanks(effs []instEffect) bool {
	any := false
	for _, e := range effs {
		switch e := e.(type) {
		case cancelRanksEffect:
			here := t.hosted(e.ranks)
			for _, r := range here {
				if r.cancel(e.key.side, e.key.id, e.cause) {
					any = true
				}
			}
			t.endedUnbegun(e.key, here, e.cause)
		case attemptFailedEffect:
			for _, r := range t.hosted(e.ranks) {
				r.decide(e.key.id, evAttemptFailed{attempt: e.attempt, err: e.cause, now: time.Now()})
			}
		case commitEffect:
			for _, r := range t.hosted(e.ranks) {
				r.decide(e.key.id, evCommit{attempt: e.attempt})
			}
		}
	}
	return any
}

// unbegunEnd is what a process remembers of a request the instance ended
// before the process began it.
type unbegunEnd struct {
	at    time.Time
	cause error
}

// endedUnbegun answers, with a group, the instance's cancel of key on
// ranks hosted here when this process has not begun key: nothing here
// would ever report those ranks' part, and the request would stay in
// flight on every process (its other ranks' Requests never complete). It
// reports each as ended with cause, and remembers key so that begin
// refuses it (a late begin would hold blocks nobody can pull) for
// kv_transfer_timeout, after which an opaque state for it has expired; a
// begin later still enters the request again, which then fails at its
// deadline and ends the same way. Without a group every rank begins a
// request at once, so this never applies. Called with applyMu held (as
// apply and start hold it), which orders it against begin.
func (t *Transceiver) endedUnbegun(key instKey, here []*rank, cause error) {
	if t.group == nil || len(here) == 0 {
		return
	}
	t.mu.Lock()
	if t.reqs[key] != nil || t.closed {
		t.mu.Unlock()
		return // begun here: the ranks report themselves
	}
	now := t.now()
	for k, u := range t.unbegun {
		if now.Sub(u.at) >= t.timeout {
			delete(t.unbegun, k)
		}
	}
	t.unbegun[key] = unbegunEnd{at: now, cause: cause}
	t.mu.Unlock()
	for _, r := range here {
		t.group.publish(rankDoneEvent{key: key, rank: r.idx, err: cause, now: now})
	}
}

// hosted returns the ranks of idx hosted here.
func (t *Transceiver) hosted(idx []int) []*rank {
	var out []*rank
	for _, i := range idx {
		if at, ok := t.pos[i]; ok {
			out = append(out, t.ranks[at])
		}
	}
	return out
}

func (t *Transceiver) completeLocked(e instCompleteEffect) {
	req := t.reqs[e.key]
	if req == nil {
		return // a request of the instance this process has not begun
	}
	delete(t.reqs, e.key)
	silent := t.silent[e.key]
	delete(t.silent, e.key)
	if t.group == nil {
		silent = e.silent
	}
	if n, ok := t.nonces[e.key]; ok {
		delete(t.nonces, e.key)
		// A pull that failed without a refusal leaves the context request
		// held (unless the failure was the context side's, and then it
		// refuses the state): its owner may pull it again.
		if e.err != nil && !errors.Is(e.err, ErrRefused) {
			t.guard.giveBack(n)
		}
	}
	req.mu.Lock()
	req.stats = e.stats
	if !e.end.IsZero() {
		req.stats.Agreement = max(0, t.now().Sub(e.end))
	}
	switch {
	case e.err != nil:
		req.state, req.err = DisaggTransError, requestErr(e.err)
	case e.key.side == sideRecv:
		req.state = DisaggGenerationTransComplete
	default:
		req.state = DisaggContextComplete
	}
	close(req.done)
	req.mu.Unlock()
	if !silent {
		if e.key.side == sideRecv {
			t.doneRecv = append(t.doneRecv, req)
		} else {
			t.doneSend = append(t.doneSend, req)
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
	return t.check(ctx, sideSend, atLeast)
}

// CheckGenTransferStatus is CheckContextTransferStatus for receives (state
// DISAGG_GENERATION_TRANS_COMPLETE or DISAGG_TRANS_ERROR).
func (t *Transceiver) CheckGenTransferStatus(ctx context.Context, atLeast int) ([]*Request, error) {
	return t.check(ctx, sideRecv, atLeast)
}

func (t *Transceiver) check(ctx context.Context, s side, atLeast int) ([]*Request, error) {
	for {
		t.mu.Lock()
		list := &t.doneSend
		if s == sideRecv {
			list = &t.doneRecv
		}
		if _, n := t.inFlightLocked(s); n == 0 || (atLeast >= 0 && len(*list) >= atLeast) {
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
	n, _ := t.inFlightLocked(sideRecv)
	return n == 0
}

// inFlightLocked counts the requests of side in flight here, and of them
// those the Check calls will report.
func (t *Transceiver) inFlightLocked(s side) (all, reported int) {
	if t.group == nil {
		return t.inst.inFlight(s)
	}
	for k := range t.reqs {
		if k.side == s {
			all++
			if !t.silent[k] {
				reported++
			}
		}
	}
	return all, reported
}

// Cancel cancels the request's transfer on every rank, on whichever side it
// is; the peers get an abort. It reports whether a transfer was cancelled
// (false when there was none in flight or it had already ended). The
// request then ends in DISAGG_TRANS_ERROR with an error wrapping
// ErrCanceled.
func (t *Transceiver) Cancel(req *Request) bool {
	why := fmt.Errorf("%w: request %d cancelled", ErrCanceled, req.ID)
	if t.group != nil {
		// Through the log, so that every process cancels it; the answer
		// is whether it is in flight here.
		t.mu.Lock()
		var keys []instKey
		for _, k := range []instKey{{sideSend, req.ID}, {sideRecv, req.ID}} {
			if t.reqs[k] != nil {
				keys = append(keys, k)
			}
		}
		t.mu.Unlock()
		for _, k := range keys {
			t.group.publish(instCancelEvent{key: k, cause: why})
		}
		return len(keys) > 0
	}
	cancels := t.step(instCancelEvent{key: instKey{sideSend, req.ID}, cause: why})
	cancels = append(cancels, t.step(instCancelEvent{key: instKey{sideRecv, req.ID}, cause: why})...)
	return t.cancelRanks(cancels)
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
	if t.group != nil {
		// The other processes see this one leave; the ranks' last
		// reports are applied here.
		t.group.leave(ErrClosed)
	}
	var errs []error
	for _, r := range t.ranks {
		if err := r.close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	if t.group != nil {
		if err := t.group.close(); err != nil {
			errs = append(errs, err)
		}
		// The group applies nothing more: a request whose ranks' last
		// reports came after it stopped (a rank's goroutine descheduled at
		// the wrong moment) would never complete. Close ends it.
		t.mu.Lock()
		for key := range t.reqs {
			t.completeLocked(instCompleteEffect{key: key, err: fmt.Errorf("%w: the transceiver closed before the instance agreed on the request's end", ErrClosed)})
		}
		t.mu.Unlock()
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
	n, _ := t.inFlightLocked(sideSend)
	return n
}

// Pulling reports whether context request req is being pulled on a rank
// of this process: a generation instance has asked for it and that pull
// attempt has neither failed nor ended, nor gone on for longer than its
// bytes take at StagingHoldRate plus ConnLimits.StagingHold (a pull that
// stalls longer counts as none). A request that no rank here holds (ended,
// or not one of this transceiver's context requests) is not.
// Engines use it to tell a held request nobody has come for from one
// whose bytes are moving (engine: releasing held requests under memory
// pressure).
func (t *Transceiver) Pulling(req *Request) bool {
	for _, r := range t.ranks {
		if r.pulling(req.ID) {
			return true
		}
	}
	return false
}

// StagingBytesInUse returns the bytes of staging buffers currently taken by
// transfers, over all ranks (role "send" or "recv").
func (t *Transceiver) StagingBytesInUse() (send, recv int64) {
	for _, r := range t.ranks {
		send += r.sendBufs.InUse() * int64(r.sendBufs.Size())
		recv += r.recvBufs.InUse() * int64(r.recvBufs.Size())
	}
	return send, recv
}

// ControlConnections returns the number of open control connections of all
// ranks (dialled and accepted).
func (t *Transceiver) ControlConnections() int {
	n := 0
	for _, r := range t.ranks {
		n += r.ctrl.Len()
	}
	return n
}
