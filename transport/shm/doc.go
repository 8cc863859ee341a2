// Package shm is kvxfer's same-host shared-memory data plane, registered as
// the transport backend "shm" by its init function (import it for that
// effect). It needs Linux; elsewhere the name is registered as unavailable.
//
// It owns moving bytes between a Send and the memory of an armed receipt
// of another transport on the same host, by having the receiver copy them
// straight out of the sender's memory; it knows nothing of requests,
// layouts or config. Like tcp, it does not authenticate peers beyond the
// unguessable tag in a descriptor.
//
// # Receiver-driven reads
//
// Nobody ever writes into another process's memory. A sender shares its
// source regions (sealed memfds, see kvcache.ShmAllocator) with the
// receiver, which maps them read-only and copies out of them into the
// receipt's memory itself. So the receiver can stop a copy whenever it
// likes, without trusting the sender, and its destination memory needs no
// registration. The copy is one memcpy per byte, done by the receiver, on
// two goroutines for transfers of two pieces or more (see Options.FrameBytes).
//
// # Endpoints, connections, regions
//
// Each Transport listens on an abstract Unix socket named "@kvxfer-shm-"
// and 128 random bits in hex: abstract sockets leave no file behind and
// exist per network namespace, so reaching one proves that both sides share
// a host and a namespace. A sender dials, lazily, one connection per
// receiver endpoint and exchanges HELLOs (magic, version). Before a Send
// first reads from a region on a connection, the sender announces it:
// REGION with its id and size, and its memory file attached (SCM_RIGHTS).
// The receiver maps it read-only (kvcache.MapShared checks the seals that
// make a mapping safe from SIGBUS) and keeps the mapping for the life of
// the connection; when the connection ends, or the transport closes, the
// mappings are unmapped, after the copies reading them have stopped.
//
// Sources must be registered (transport.MemoryRegistrar) with their memory
// file: a Send whose source is not fails with ErrNotShared.
//
// # Ops
//
// A Send is one op on the connection: READ parts (op id, the receipt's
// tag, the part's offset in the receipt, up to 4096 segments of (region,
// offset, length); adjacent pieces of src are merged) ending with one
// flagged last. The receiver checks every segment against its region's
// bounds, binds the op to the receipt of the tag (checking the length), and
// queues it; a worker goroutine per connection copies the queued ops in
// order, checking between pieces whether to go on. It answers DONE when
// every byte is in place, or ERR with a code and a reason. On DONE the
// sender writes ACK and Send returns nil; the receipt completes when the
// ACK arrives. (So a receiver can never complete a receipt with bytes from
// a sender that had given up and gone on to reuse its memory.) Wire
// formats are in wire.go.
//
// Credit bounds what a receiver holds per connection: each op in flight
// weighs 64 plus its segments, 2 Mi in all; a sender waits for credit, and
// a receiver closes a connection that exceeds it.
//
// # Cancel and failure
//
// Send: when ctx ends, a Send whose READ has gone out writes CANCEL and
// waits up to a second for the answer: ERR (the receiver stopped before its
// next piece; the receipt fails with transport.ErrAborted) and Send returns
// the ctx error, or DONE (all copied already) and Send returns nil. If no
// answer comes, the connection is closed (failing the other ops on it).
// A Send that ends before its READ went out writes ABORT for the tag (dialling
// for it if needed, within a second), which fails the receipt with
// transport.ErrAborted unless another Send is filling it. Close of the
// Transport cancels its Sends the same way.
//
// Recv.Cancel: the receipt ends with transport.ErrCanceled; a copy into it
// stops before its next piece and Cancel returns once it has. The sender's
// Send fails with ErrRefused and transport.ErrCanceled (unless it had been
// answered DONE). A READ for an unknown or ended tag is answered ERR and
// the connection stays up.
//
// A malformed message, a segment outside its region, or a sender that
// exceeds its credit closes that connection only (transport.ErrProtocol,
// logged). A connection that ends fails every receipt an op of it was
// filling, or awaiting the ACK for, with transport.ErrPeerLost (wrapping
// the protocol error, if any); a receipt that has seen no READ is left to
// the caller's deadline. A sender sees a broken connection at once (its
// reader goroutine) and fails the Sends waiting on it with
// transport.ErrPeerLost; the next Send redials.
//
// # Probe
//
// Probe dials the endpoint on a connection of its own, announces a
// 4 KiB sealed memfd holding a random value and sends PROBE; the peer maps
// it and answers with the value it reads, which proves the same host and
// working shared mappings (PROBEOK), or with the reason it cannot (ERR).
package shm
