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
	// UCXInterface is the network interface for UCX's bootstrap
	// (TRTLLM_UCX_INTERFACE); empty = UCX's choice.
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

// Resolve resolves ct's backend against its environment snapshot and the
// backends of this binary (see ResolveBackend).
func (ct *CacheTransceiver) Resolve(available func(Backend) error) Resolution {
	return ResolveBackend(ct.Backend, ct.Env, available)
}

// Validate checks a CacheTransceiver that was built by hand against the same
// rules the loader applies, with tokensPerBlock the pool's block size.
func (ct *CacheTransceiver) Validate(tokensPerBlock int) error {
	c := &collector{}
	validateCT(ct, tokensPerBlock, c, "cache_transceiver_config", nil)
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
}

// Worker is the worker file form: TRT-LLM's extra LLM API options file
// (--extra_llm_api_options / --config), of which kvxfer reads the keys
// below and lists the other known keys as ignored.
type Worker struct {
	TensorParallelSize   int // default 1
	PipelineParallelSize int // default 1
	KVCache              KVCache
	// CacheTransceiver is nil when the file has no cache_transceiver_config
	// (an aggregated worker).
	CacheTransceiver *CacheTransceiver
	// Security is the kvxfer security block with its environment
	// variables applied (set even when the file has no block).
	Security Security
}

// Router policies of a server group.
const (
	RouterRoundRobin    = "round_robin"
	RouterLoadBalancing = "load_balancing"
	RouterKVCacheAware  = "kv_cache_aware"
)

// ServerGroup is context_servers or generation_servers of a cluster file.
type ServerGroup struct {
	NumInstances         int // default 1
	TensorParallelSize   int // default 1
	PipelineParallelSize int // default 1
	// URLs are host:port of each instance; empty means the launcher picks
	// free ports. When given there is one per instance.
	URLs             []string
	Router           string // round_robin (default) or load_balancing
	KVCache          KVCache
	CacheTransceiver *CacheTransceiver // never nil after a successful load
}

// Cluster is the cluster file form (TRT-LLM's disagg_config.yaml), read by
// the router and the launcher.
type Cluster struct {
	Hostname   string // router host, default DefaultHostname (localhost)
	Port       int    // router port, default DefaultPort (8000)
	Context    ServerGroup
	Generation ServerGroup
	// Security applies to the router and to every worker of the cluster.
	Security Security
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
}

// String formats the source as shown by `kvxfer config check`.
func (s Source) String() string {
	switch s.Kind {
	case SourceFile:
		return fmt.Sprintf("file %s:%d:%d", s.File, s.Line, s.Col)
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
	// Warnings are problems of severity SevWarning: ignored keys, and the
	// like.
	Warnings []Problem
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

// NewCacheTransceiver returns the config of a worker started from flags
// rather than a file: backend b (parsed, any case), every other file field
// at its default, the environment applied, validated against
// tokensPerBlock.
func NewCacheTransceiver(b string, tokensPerBlock int, env Env) (*CacheTransceiver, error) {
	backend, err := ParseBackend(b)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	ct := defaultCacheTransceiver(backend)
	c := &collector{}
	applyEnv(ct, env, c, map[string]Source{}, "")
	validateCT(ct, tokensPerBlock, c, "cache_transceiver_config", nil)
	if errs := c.errs(); len(errs) > 0 {
		return nil, errs
	}
	return ct, nil
}
