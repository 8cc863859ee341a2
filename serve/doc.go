// Package serve is kvxfer's serving layer: the OpenAI-compatible worker
// (context, generation or both) with TensorRT-LLM's disaggregated_params,
// the router that runs the disaggregated flow across context and generation
// workers, and the launcher behind `kvxfer up`.
//
// It owns HTTP: request parsing and validation, streaming (server-sent
// events), policies, retries, health and metrics (on a registry of its
// own). The model and the executor are package engine's; the KV movement is
// package transceiver's.
//
// HTTP servers (worker, router) run within HTTPLimits: a total and a
// per-client-host cap on open connections (the excess is refused at once),
// a keep-alive idle timeout and a header timeout; kvxfer_connections_*
// count them.
package serve
