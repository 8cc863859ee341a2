package config

import (
	"fmt"
	"time"
)

// Limits of the file fields. Their defaults are in defaults.go.
const (
	// MaxKVTransferTimeoutMs is one day.
	MaxKVTransferTimeoutMs = 24 * 60 * 60 * 1000
	// MaxTokensInBufferLimit bounds max_tokens_in_buffer (16 Mi tokens).
	MaxTokensInBufferLimit = 1 << 24
	// MaxTokensPerBlock bounds kv_cache_config.tokens_per_block.
	MaxTokensPerBlock = 1 << 16
	// MaxPoolTokens bounds kv_cache_config.max_tokens.
	MaxPoolTokens = 1 << 26
	// MaxParallel bounds tensor/pipeline parallel sizes and instance counts.
	MaxParallel = 1024
)

// CacheTransceiver is TensorRT-LLM's cache_transceiver_config, typed and
// validated, together with the environment-derived settings of the
// transfer path. It is read by transceiver.New and by nothing below it.
//
// The zero value is "no transceiver". Use Load* to obtain a filled one; a
// CacheTransceiver built by hand should be passed through Validate.
type CacheTransceiver struct {
	// Backend is the configured backend, upper case. BackendUnset means no
	// transceiver. DEFAULT is resolved with ResolveBackend.
	Backend Backend
	// MaxTokensInBuffer sizes each pre-allocated staging buffer in tokens.
	// 0 means unset: TransferBufferSize (bytes) is used instead. When set it
	// is > 0 and a multiple of tokens_per_block.
	MaxTokensInBuffer int
	// KVTransferTimeoutMs is the deadline, in milliseconds, of one
	// transfer on either side, counted from the moment the request enters
	// the transceiver. Default DefaultKVTransferTimeoutMs; 1..one day.
	KVTransferTimeoutMs int
	// SenderFutureTimeoutMs is kv_transfer_sender_future_timeout_ms: on
	// the context side, how long a rank waits for its sends to finish
	// once the generation side has asked for them, before it ends the
	// request in error and frees its blocks. 0 means unset: only
	// KVTransferTimeoutMs bounds the wait. TensorRT-LLM's field of the same
	// name (default 1000) bounds one poll of its send futures instead;
	// kvxfer gives it the meaning above and no default, because a
	// deadline of one second would fail large transfers.
	SenderFutureTimeoutMs int
	// Runtime is transceiver_runtime (CPP or PYTHON): which of
	// TensorRT-LLM's implementations runs the transfer. Accepted and
	// reported as not applicable: kvxfer is its own runtime. "" = unset.
	Runtime string

	// TransferBufferSize is the size in bytes of each staging buffer when
	// MaxTokensInBuffer is unset (TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE,
	// default 512 MiB; 0 = no pre-allocated buffer, chunks are then sized
	// one block at a time).
	TransferBufferSize int64
	// SendBuffers is the number of send staging buffers and send workers
	// (TRTLLM_KVCACHE_SEND_MAX_CONCURRENCY_NUM, default 2).
	SendBuffers int
	// RecvBuffers is the number of receive staging buffers: 1, or
	// TRTLLM_KVCACHE_RECV_BUFFER_COUNT (default 2) when
	// TRTLLM_REQUEST_KV_CACHE_CONCURRENT=1.
	RecvBuffers int
	// ZeroCopy sends blocks straight from pool memory when both layouts
	// are identical (TRTLLM_TRY_ZCOPY_FOR_KVCACHE_TRANSFER; kvxfer's
	// default is on, 0 turns it off).
	ZeroCopy bool
	// TimeOutputPath is a directory for per-rank transfer timing CSV files
	// (TRTLLM_KVCACHE_TIME_OUTPUT_PATH); empty = none.
	TimeOutputPath string
	// UCXInterface is TRTLLM_UCX_INTERFACE: the network interface the UCX
	// backend's listener and side channel use; empty = UCX's choice. The
	// loader checks that the interface exists; the UCX backend binds its
	// first IPv4 address (transport.Options.Interface).
	UCXInterface string
	// Env is the environment snapshot the config was loaded with; DEFAULT
	// resolution reads it.
	Env Env
}

// Timeout returns KVTransferTimeoutMs as a duration, or the default when
// unset.
func (ct *CacheTransceiver) Timeout() time.Duration {
	ms := ct.KVTransferTimeoutMs
	if ms <= 0 {
		ms = DefaultKVTransferTimeoutMs
	}
	return time.Duration(ms) * time.Millisecond
}

// SenderTimeout returns SenderFutureTimeoutMs as a duration, or 0 when it
// is unset.
func (ct *CacheTransceiver) SenderTimeout() time.Duration {
	return time.Duration(max(ct.SenderFutureTimeoutMs, 0)) * time.Millisecond
}

// Resolve resolves ct's backend against its environment snapshot and the
// backends of this binary (see ResolveBackend).
func (ct *CacheTransceiver) Resolve(available func(Backend) error) Resolution {
	return ResolveBackend(ct.Backend, ct.Env, available)
}

// Validate checks a CacheTransceiver that was built by hand against the same
// rules the loader applies, with tokensPerBlock the pool's block size.
func (ct *CacheTransceiver) Validate(tokensPerBlock int) error {
	c := &collector{}
	validateCT(ct, tokensPerBlock, c, "cache_transceiver_config", "cache_transceiver_config", nil)
	if errs := c.errs(); len(errs) > 0 {
		return errs
	}
	return nil
}

// KVCache is the subset of TRT-LLM's kv_cache_config that kvxfer uses.
type KVCache struct {
	// TokensPerBlock is the number of tokens in one paged block
	// (default 32).
	TokensPerBlock int
	// MaxTokens is the pool size of each rank, in tokens (default 16384);
	// the pool holds ceil(MaxTokens/TokensPerBlock) blocks.
	MaxTokens int
	// EnableBlockReuse (enable_block_reuse) publishes full KV blocks for
	// reuse by later requests with the same prefix; EnablePartialReuse
	// (enable_partial_reuse) also reuses a block whose first tokens match;
	// CopyOnPartialReuse (copy_on_partial_reuse) lets partial reuse copy a
	// block others use. Nil means unset: TensorRT-LLM's default, true.
	// Read the effective values with Reuse.
	EnableBlockReuse   *bool
	EnablePartialReuse *bool
	CopyOnPartialReuse *bool
	// EventBufferMaxSize (event_buffer_max_size) is the number of KV cache
	// events a worker keeps for a router to read; 0 (the default) keeps
	// none.
	EventBufferMaxSize int
}

// MaxEventBufferSize bounds kv_cache_config.event_buffer_max_size.
const MaxEventBufferSize = 1 << 20

// Reuse returns the effective enable_block_reuse, enable_partial_reuse
// and copy_on_partial_reuse: the values set, true where unset.
func (k KVCache) Reuse() (block, partial, copyOnPartial bool) {
	or := func(b *bool) bool { return b == nil || *b }
	return or(k.EnableBlockReuse), or(k.EnablePartialReuse), or(k.CopyOnPartialReuse)
}

// Worker is the worker file form: TRT-LLM's extra LLM API options file
// (--extra_llm_api_options / --config), of which kvxfer reads the keys
// below; every other key is a warning ("not used by kvxfer").
type Worker struct {
	TensorParallelSize   int // default 1
	PipelineParallelSize int // default 1
	KVCache              KVCache
	// CacheTransceiver is nil when the file has no cache_transceiver_config
	// (an aggregated worker).
	CacheTransceiver *CacheTransceiver
	// DisaggCluster is the worker's disagg_cluster block (dynamic
	// membership), nil when absent: kvxfer serve registers the worker there.
	DisaggCluster *DisaggCluster
	// Security is the kvxfer security block with its environment
	// variables applied (set even when the file has no block).
	Security Security
}

// Router policies of a server group: TensorRT-LLM's names.
const (
	RouterRoundRobin    = "round_robin"
	RouterLoadBalancing = "load_balancing"
	// RouterKVCacheAware sends a request to the worker whose reusable KV
	// cache holds the longest prefix of its prompt, less its load
	// (RouterArgs.MaxBatchSize); RouterConversation keeps a conversation
	// on the worker that served it (RouterArgs.MaxSessions and the rest).
	RouterKVCacheAware = "kv_cache_aware"
	RouterConversation = "conversation"
)

// RouterArgs are the arguments of a server group's router block that
// kvxfer applies (TensorRT-LLM's router keys beside type), defaults filled
// in (DefaultRouterArgs). use_tokens and use_token_ids load and are not
// used: kvxfer's load is requests in flight, and its router always has the
// prompt's token ids.
type RouterArgs struct {
	// MaxBatchSize (kv_cache_aware, default 64) weighs the load in a
	// worker's score: matched prefix fraction minus in-flight requests /
	// MaxBatchSize.
	MaxBatchSize int
	// TokensPerBlock (conversation, default 128) is the block size of the
	// prefix hashes that match a request without conversation_id to an
	// earlier one. kv_cache_aware ignores it: it hashes with the workers'
	// kv_cache_config.tokens_per_block, as their caches do.
	TokensPerBlock int
	// MaxSessions (conversation, default 100000) bounds the conversations
	// the router remembers; the least recently used one goes first.
	MaxSessions int
	// MatchThreshold (conversation, default 0.75) is the fraction of a
	// request's prefix blocks an earlier request must share for the
	// request to continue its conversation.
	MatchThreshold float64
	// HashSkipCount (conversation, default 0) leading tokens are left out
	// of the prefix hashes (a shared system prompt).
	HashSkipCount int
}

// DefaultRouterArgs are TensorRT-LLM's router defaults.
func DefaultRouterArgs() RouterArgs {
	return RouterArgs{MaxBatchSize: 64, TokensPerBlock: 128, MaxSessions: 100000, MatchThreshold: 0.75}
}

// ServerGroup is context_servers or generation_servers of a cluster file,
// with the LLM API options of the file's top level merged in (a group's
// own value wins).
type ServerGroup struct {
	// NumInstances is the number of workers (default 1). 0 is TensorRT-LLM's
	// generation-only benchmark mode for context_servers: it loads, and
	// kvxfer up refuses to start it.
	NumInstances         int
	TensorParallelSize   int // default 1
	PipelineParallelSize int // default 1
	// URLs are host:port of each instance; empty means the launcher picks
	// free ports. When given there is one per instance.
	URLs []string
	// Router is the policy as written, lower case: round_robin (default),
	// load_balancing, kv_cache_aware or conversation.
	Router string
	// RouterArgs are the router block's other keys.
	RouterArgs RouterArgs
	KVCache    KVCache
	// CacheTransceiver is nil when neither the group nor the top level has
	// a cache_transceiver_config: its workers are started separately with
	// their own worker files. kvxfer up then uses backend DEFAULT.
	CacheTransceiver *CacheTransceiver
}

// Cluster is the cluster file form (TRT-LLM's disagg_config.yaml), read by
// the router and the launcher.
type Cluster struct {
	Hostname   string // router host, default DefaultHostname (localhost)
	Port       int    // router port, default DefaultPort (8000)
	Context    ServerGroup
	Generation ServerGroup
	// ConditionalDisagg is conditional_disagg_config, nil when absent.
	ConditionalDisagg *ConditionalDisagg
	// DisaggCluster is disagg_cluster (dynamic membership), nil when
	// absent. With it the file may leave out both server groups, and the
	// router takes its workers from the membership.
	DisaggCluster *DisaggCluster
	// Security applies to the router and to every worker of the cluster.
	Security Security
}

// ConditionalDisagg is conditional_disagg_config: a request whose prompt
// the chosen generation worker has partly cached, with at most
// MaxLocalPrefillLength tokens left to compute, is prefilled on that
// generation worker itself (context_and_generation, no transfer); any
// other goes through a context worker. As TensorRT-LLM, a prompt with
// nothing cached always goes through a context worker.
type ConditionalDisagg struct {
	MaxLocalPrefillLength int
}

// DisaggCluster is TensorRT-LLM's disagg_cluster block: workers register
// themselves in a store instead of being listed in urls.
type DisaggCluster struct {
	// ClusterURI is http://host:port (the disaggregated server keeps the
	// store) or etcd://host:port[,host:port]; ParseClusterURI reads it.
	ClusterURI string
	// ClusterName is one element of the store's keys (CheckClusterName).
	ClusterName string
	// MinContext and MinGeneration are minimal_instances (default 1 and
	// 1): below them the router is not ready.
	MinContext, MinGeneration int
	// HeartbeatIntervalSec (default 5) and InactiveTimeoutSec (default 10,
	// the lease's TTL) meet CheckHeartbeat: 2 × interval ≤ timeout.
	HeartbeatIntervalSec int
	InactiveTimeoutSec   int
}

// Kind tells the two file forms apart.
type Kind uint8

// File kinds.
const (
	KindWorker Kind = iota + 1
	KindCluster
)

func (k Kind) String() string {
	switch k {
	case KindWorker:
		return "worker"
	case KindCluster:
		return "cluster"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// SourceKind says where a value came from.
type SourceKind uint8

// Source kinds.
const (
	SourceDefault SourceKind = iota
	SourceFile
	SourceEnv
)

// Source is where one effective value came from.
type Source struct {
	Kind      SourceKind
	File      string
	Line, Col int
	Env       string // variable name, for SourceEnv
	// Note qualifies a file source: "top level" for a value a server group
	// took from the cluster file's top level, or the older form a value
	// was implied by.
	Note string
}

// String formats the source as shown by `kvxfer config check`.
func (s Source) String() string {
	switch s.Kind {
	case SourceFile:
		out := fmt.Sprintf("file %s:%d:%d", s.File, s.Line, s.Col)
		if s.Note != "" {
			out += " (" + s.Note + ")"
		}
		return out
	case SourceEnv:
		return "env " + s.Env
	}
	return "default"
}

// File is one loaded config file: its kind, its typed content, where every
// value came from, and the warnings found while loading it.
type File struct {
	Path    string
	Kind    Kind
	Worker  *Worker  // set when Kind == KindWorker
	Cluster *Cluster // set when Kind == KindCluster
	// Sources maps a field path ("cache_transceiver_config.backend",
	// "context_servers.tensor_parallel_size") to where its value came from.
	// Fields absent from the map came from defaults.
	Sources map[string]Source
	// Warnings are problems of severity SevWarning: keys kvxfer does not
	// use, settings it accepts but does not apply, older forms, and the
	// like (see Problem.Kind).
	Warnings []Problem
}

// NotApplied returns the warnings about settings that are accepted but
// have no effect in kvxfer (Kind KindNotApplied).
func (f *File) NotApplied() []Problem {
	return filter(f.Warnings, func(p Problem) bool { return p.Kind == KindNotApplied })
}

// Source returns where the value at path came from.
func (f *File) Source(path string) Source {
	if s, ok := f.Sources[path]; ok {
		return s
	}
	return Source{Kind: SourceDefault}
}

// Transceivers returns every cache_transceiver_config of the file with its
// path prefix ("" for a worker, "context_servers." and
// "generation_servers." for a cluster). Nil entries are skipped.
func (f *File) Transceivers() []NamedTransceiver {
	var out []NamedTransceiver
	switch {
	case f.Worker != nil && f.Worker.CacheTransceiver != nil:
		out = append(out, NamedTransceiver{"cache_transceiver_config", f.Worker.CacheTransceiver})
	case f.Cluster != nil:
		for _, g := range []struct {
			p string
			g *ServerGroup
		}{{"context_servers", &f.Cluster.Context}, {"generation_servers", &f.Cluster.Generation}} {
			if g.g.CacheTransceiver != nil {
				out = append(out, NamedTransceiver{g.p + ".cache_transceiver_config", g.g.CacheTransceiver})
			}
		}
	}
	return out
}

// NamedTransceiver is a CacheTransceiver with its field path.
type NamedTransceiver struct {
	Path string
	CT   *CacheTransceiver
}
