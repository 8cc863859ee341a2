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
//
// Every listener binds Options.ListenHost (the data backends get it as
// transport.Options.ListenAddr; Listeners reports them all). Inbound
// connections are bounded before and after their handshake (ConnLimits):
// a total and a per-host cap on each rank's control connections (the
// excess is closed at once, logged at most once a second per reason), a
// handshake timeout, and an idle timeout after which a control connection
// with no request in flight is closed; the dialling side closes its own a
// little earlier and redials when it next needs one. An Observer that is
// also a ConnObserver counts them.
package transceiver
