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
// HTTP servers (worker, router) run within HTTPLimits: a total and a
// per-client-host cap on open connections (the excess is refused at once),
// a keep-alive idle timeout and a header timeout; kvxfer_connections_*
// count them.
package serve
