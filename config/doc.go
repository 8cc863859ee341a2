// Package config owns kvxfer's typed configuration: the
// cache_transceiver_config block of TensorRT-LLM (CacheTransceiver), the two
// file forms it appears in (a worker's extra LLM API options file and a
// cluster's disagg_config.yaml), the TRT-LLM environment variables of the
// KV-cache transfer path, and the DEFAULT backend resolution.
//
// Loading always runs in one order: defaults (defaults.go, the one place
// they are set; DefaultWorker) → strict YAML → environment → Validate. Every problem found on the way is collected, with its field path
// and file:line:column, and reported at once as a Problems error; nothing is
// reported one error at a time.
//
// Files carry over from TensorRT-LLM with its meaning (keys.go states the
// rule): a cluster file's top-level LLM API options apply to both server
// groups, a group's own value winning key by key; a key kvxfer does not read
// is a warning, an error only when it is a near miss of a key kvxfer reads
// or sits in a strict block; older forms load with a warning naming the
// current one; settings kvxfer accepts but does not apply are warnings of
// kind KindNotApplied (File.NotApplied), so that config check can list them.
//
// The typed CacheTransceiver is the only configuration that travels through
// the program. It is turned into transport options at exactly one place,
// transceiver.New; no package below the transceiver (transport, layout,
// kvcache) imports config, and internal/repotest's boundary table enforces
// that.
//
// Security is kvxfer's own `security:` block (TensorRT-LLM has none), at
// the top level of either file form: where the cluster secret is (a file or
// an environment variable; never the secret itself), the peer hosts a worker
// may dial and accept transfer connections from (merged with TensorRT-LLM's
// TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS), and the TLS files. The loader checks
// the block's shape; the secret file is read by Security.LoadSecret and the
// TLS files where TLS is set up, not at load.
//
// LoadFile reads a regular file or a named pipe (process substitution),
// up to MaxFileSize; a pipe's writer is waited for at most PipeTimeout,
// so that a pipe nobody writes to fails naming it rather than block the
// CLI or the C ABI's caller for ever. Security.LoadSecret and
// EtcdClient.LoadPassword read their files the same way.
//
// config does not know which backends a binary was built with: callers pass
// that in (see ResolveBackend), so resolution stays a pure function.
package config
