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
// # Signed opaque states and allowed peers
//
// The opaque state a context instance hands out (request id, transfer
// token, CacheState, the control endpoint of each rank) travels through the
// client-facing router, so it is untrusted input to the generation instance
// that receives it. With a cluster secret (Options.Secret) the context side
// signs it: version 2 of the encoding adds an expiry (the moment the context
// side releases the blocks anyway: issue time + kv_transfer_timeout_ms), a
// random 128-bit nonce and an HMAC-SHA256 over every byte before it, under a
// key derived from the secret with HKDF. The generation side, before it
// dials anything, refuses a state that is unsigned (ErrUnsignedOpaqueState),
// whose MAC does not match (ErrForgedOpaqueState, compared in constant
// time), that has expired (ErrExpiredOpaqueState) or whose nonce it has
// already accepted (ErrReplayedOpaqueState). Accepted nonces are kept until
// their expiry, at most Options.NonceCacheSize of them; when that many are
// unexpired, new states are refused (ErrReplayCacheFull) rather than old
// nonces forgotten. Expiry compares the generation host's clock with the
// context host's: a clock skew between them shortens or stretches the
// window by as much, so keep the clocks of a cluster in sync.
//
// Dial targets are checked too (ErrPeerNotAllowed): loopback always; with an
// allow-list (Options.AllowedPeerHosts) the hosts on it; without a secret
// nothing else (the instance logs once, as a warning, that it is
// unauthenticated); with a secret and no allow-list any host, since the
// signature vouches for the endpoints. With an allow-list, the control
// listener serves connections from loopback and the listed hosts only.
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
