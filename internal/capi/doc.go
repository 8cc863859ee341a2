// Package capi is the logic behind kvxfer's C ABI (cmd/libkvxfer,
// include/kvxfer.h), written in plain Go so that it is tested in Go: the
// integer handles C holds instead of Go pointers, the result codes of the
// header and how errors map to them, loading a config as `kvxfer config
// check` does, building an instance's CacheState from the caller's
// description, wrapping the caller's pool memory (or allocating a shareable
// one), and the per-side queues of finished requests that the status calls
// drain into the caller's arrays.
//
// It owns no protocol: every transfer is the transceiver's. It does not
// know C: cmd/libkvxfer turns C arguments into Go values (the caller's pool
// memory into a []byte over memory Go never frees) and Go errors into the
// header's codes and the thread's last-error message.
//
// # Pools
//
// The engine, not kvxfer, decides which blocks hold which request. So that
// the transceiver's pool bookkeeping (it takes a reference on the blocks of
// a context request while it holds them) accepts any block id the engine
// names, Open pins every block of every pool once, for the life of the
// Transceiver. The caller must not reuse the blocks of a request until a
// status call has reported it finished (as upstream).
//
// # Ranks in several processes
//
// A Transceiver hosts the ranks Options.Ranks of its instance; when they
// are not all of them, Options.Group says how the processes agree (see
// transceiver.Group): GroupCoordinated over kvxfer's own connections, or
// GroupGather through the caller's all-gather, which the caller polls
// (Outbox, HandedOut, Deliver, Fail) since C gets no callbacks.
//
// # Concurrency
//
// Every method of Transceiver and Table is safe for concurrent use (the
// rounds of a gather group, Outbox to Deliver, must not overlap). A
// Transceiver starts goroutines (the transceiver's) in Open; Close stops
// them and is idempotent.
package capi
