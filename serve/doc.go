// Package serve is kvxfer's serving layer: the OpenAI-compatible worker
// (context, generation or both) with TensorRT-LLM's disaggregated_params,
// and the router that runs the disaggregated flow across context and
// generation workers. The launcher behind `kvxfer up`, which starts them as
// processes, is internal/launch.
//
// It owns HTTP: request parsing and validation, streaming (server-sent
// events, and StreamCompletion to read them), policies, retries, health and
// the /metrics route (on a registry of its own; the collectors are package
// metrics'). The model and the executor are package engine's; the KV
// movement is package transceiver's, and serve never reaches below it to
// package transport.
//
// Mutual TLS (optional; internal/tlsconf builds the configs): a worker
// with WorkerOptions.TLS has its transceiver's control and tcp data
// connections in TLS, and kvxfer serve serves its HTTP API over TLS that
// requires a client certificate of the cluster CA. The router
// (RouterOptions.TLS) dials the workers with its own certificate; its
// client-facing listener stays plain HTTP. internal/launch (kvxfer up
// --tls) makes a CA and a certificate per process for the cluster it
// starts.
//
// Migration: when a generation worker fails mid-request (its stream cut,
// its connection lost, the chunk deadline missed, or a 502/504 or an error
// before any output), the router sends the request again, context phase
// included, resumed after the tokens its client already has
// (ResumeField, engine.Request.Resume), to another generation worker, and
// the client's stream continues as if nothing happened; at most
// RouterOptions.MigrationLimit times (DefaultMigrationLimit; kvxfer
// router's and kvxfer up's --migration-limit, 0 for off). A request that
// cannot migrate ends with an error event and no [DONE] (a 502 or 504
// when not streamed).
//
// Routing policies (per server group, TensorRT-LLM's): round_robin,
// load_balancing, kv_cache_aware and conversation (see Policy). The
// kv_cache_aware router polls each worker's KVEventsPath with a goroutine
// of its own (started by the first routed request, stopped by Close) and
// keeps, per worker, the block hashes it holds; it hashes prompts itself
// with package kvcache's HashBlocks, as the workers' caches do. The pure
// parts (scores, the conversation memory, applying events) are in
// policy.go. Conditional disaggregation (RouterOptions.ConditionalDisagg)
// asks the chosen generation worker CachedPrefixPath and sends a prompt it
// has mostly cached there as context_and_generation; RouteHeader says
// which path a request took. The worker's reuse routes require
// ReuseToken(secret) when the cluster has a secret: they tell what other
// users' prompts share with one's own.
//
// The router's /health probes every worker in one round that all its
// callers share, and answers from that round for HealthReuse after it,
// so that its clients cannot multiply the probes the workers get.
//
// HTTP servers (worker, router) run within HTTPLimits: a total and a
// per-client-host cap on open connections (the excess is refused at once),
// a keep-alive idle timeout and a header timeout; kvxfer_connections_*
// count them.
package serve
