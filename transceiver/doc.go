// Package transceiver moves a request's KV cache from the ranks of a context
// (prefill) instance to the ranks of a generation (decode) instance, with the
// API and request states of TensorRT-LLM's cache transceiver.
//
// It is the only package that knows both the public config and the
// transports: New reads config.CacheTransceiver and turns it into
// transport.Options, in one place. Each rank runs a small pure state
// machine per request (core.go: events in, effects out) driven by a thin
// layer of goroutines (rank.go) that owns the control connections, the data
// plane and the staging buffers.
package transceiver
