package config

// Every default of the typed forms is here: the loader starts from these
// values before it reads a file, and the callers that build a form without
// a file (kvxfer serve without --config, serve.NewWorker without a Config,
// bench) start from the same ones.

// Defaults of the file fields.
const (
	// DefaultKVTransferTimeoutMs applies when kv_transfer_timeout_ms is
	// unset. TRT-LLM then has no timeout; kvxfer applies one so that blocks
	// held for a generation instance that never comes are always released.
	DefaultKVTransferTimeoutMs = 60_000
	// DefaultTokensPerBlock is TRT-LLM's default block size in tokens.
	DefaultTokensPerBlock = 32
	// DefaultPoolTokens is the default kv_cache_config.max_tokens: the KV
	// pool of each rank holds this many tokens.
	DefaultPoolTokens = 16384
	// DefaultHostname is the router host of a cluster file.
	DefaultHostname = "localhost"
	// DefaultPort is the router port of a cluster file.
	DefaultPort = 8000
)

// Defaults of the environment-derived settings.
const (
	DefaultTransferBufferSize = 512 << 20 // bytes, TRT-LLM's default
	DefaultSendBuffers        = 2
	DefaultConcurrentRecv     = 2 // receive buffers when TRTLLM_REQUEST_KV_CACHE_CONCURRENT=1
)

// DefaultKVCache returns kv_cache_config with every field at its default.
func DefaultKVCache() KVCache {
	return KVCache{TokensPerBlock: DefaultTokensPerBlock, MaxTokens: DefaultPoolTokens}
}

// DefaultWorker returns the worker form of a file without keys: TP1 PP1,
// the default kv_cache_config, no cache_transceiver_config (an aggregated
// worker) and an empty security block (no environment applied; see
// SecurityFromEnv).
func DefaultWorker() *Worker {
	return &Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: DefaultKVCache()}
}

// defaultCacheTransceiver is a cache_transceiver_config with backend b and
// every other file field at its default, before the environment applies.
func defaultCacheTransceiver(b Backend) *CacheTransceiver {
	return &CacheTransceiver{Backend: b, KVTransferTimeoutMs: DefaultKVTransferTimeoutMs}
}

// defaultServerGroup is a server group without keys (it still needs a
// cache_transceiver_config to be valid).
func defaultServerGroup() ServerGroup {
	return ServerGroup{NumInstances: 1, TensorParallelSize: 1, PipelineParallelSize: 1, Router: RouterRoundRobin, RouterArgs: DefaultRouterArgs(), KVCache: DefaultKVCache()}
}

// dynamicGroup is a server group a cluster file with disagg_cluster leaves
// out: its workers are to register themselves, none is listed.
func dynamicGroup() ServerGroup {
	g := defaultServerGroup()
	g.NumInstances = 0
	return g
}

// defaultCluster is a cluster file's top level without keys.
func defaultCluster() *Cluster {
	return &Cluster{Hostname: DefaultHostname, Port: DefaultPort}
}
