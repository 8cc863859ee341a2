// Package tcp is kvxfer's pure-Go TCP data plane, registered as the
// transport backend "tcp" by its init function (import it for that effect).
//
// It owns moving bytes between a Send and the memory of an armed receipt
// over TCP connections; it knows nothing of requests, layouts or config.
// Without TLS it does not authenticate peers beyond the unguessable tag in a
// descriptor: whoever holds a descriptor can fill, or abort, that receipt.
//
// # TLS
//
// With transport.Options.TLS every data connection is mutual TLS (the
// configs come from the caller; internal/tlsconf builds them: TLS 1.3,
// client certificates required and verified against the cluster CA). The
// receiver runs the handshake in the connection's reader, within the
// preface timeout, and refuses a client without a valid certificate, or a
// plain TCP one, with a log line; the listener keeps serving. The sender
// checks the receiver's certificate against the host of the descriptor's
// endpoint; a failed handshake fails that stream's dial, and Send fails
// with transport.ErrPeerLost naming the handshake when no stream can dial.
// Under TLS 1.3 a client's handshake ends before the server has checked its
// certificate, so a sender waits for the receiver's one-byte accept of the
// preface before it writes a frame: a receiver that refuses the sender's
// certificate fails the sender's dial ("refused the data connection", with
// the TLS alert), however small the Send, and the receipt sees nothing of
// it. Name reports "tcp(tls)".
//
// The wire format inside TLS is unchanged. crypto/tls has no vectored
// write, so a frame is written a piece at a time (header, payload pieces,
// padding), each sealed into records of at most 16 KiB, which are gathered
// into writes of up to 256 KiB (a system call per record cost a third more
// system time); every write error
// on a TLS connection drops it (crypto/tls cannot resume after one).
// Connections are closed at the TCP level, without a close_notify alert,
// which crypto/tls would wait for a stalled peer to take for up to 5 s; a
// receiver sees such an end at a record boundary as the clean end it is.
//
// # Receipts, tags and descriptors
//
// Expect registers a receipt under a random 64-bit tag from crypto/rand and
// returns its descriptor: version, the receiver's endpoint, the tag and the
// total length (wire formats in wire.go). A peer cannot write into another
// receipt's memory without its tag.
//
// # Frames and streams
//
// A sender dials, lazily, Options.Streams connections per receiver endpoint
// (TCP_NODELAY) and starts each with a preface: magic, protocol version and
// a random session id shared by all connections of that sending Transport.
// The receiver answers a valid preface with one accept byte, and the sender
// uses the connection only after reading it (one round trip per pooled
// connection), so a refused connection fails the dial, not a later Send.
// Send cuts its bytes into frames of at most Options.FrameBytes; each frame
// is a fixed 64-byte header (type, tag, offset, length, reserved space)
// followed by the payload and zero padding to a multiple of 64 bytes, written
// with one vectored write straight from the caller's slices. (The padding
// keeps every payload 64-byte aligned in the kernel's socket buffers; copies
// between misaligned addresses run at half speed or worse.) The frames of one Send are spread over the streams, one goroutine
// per stream; concurrent Sends share the connections and interleave at frame
// boundaries (a write lock per connection).
//
// Each accepted connection has one reader. It checks every header (a known
// type, a length of at most transport.MaxFrameBytes, the frame inside its
// receipt) and reads the payload straight into the receipt's memory: on
// Linux without TLS with readv, the spans the frame covers and its padding
// in one system call (up to 1024 spans, as many bytes as the socket holds),
// so that a receipt cut into many short spans (a direct scatter into the
// blocks of another layout) costs no more system calls than one buffer;
// otherwise one Read per span. A reader that finds its socket empty in the
// middle of a frame raises SO_RCVLOWAT to what it still needs of the frame,
// at most 1 MiB, so that it is woken once that much has arrived rather than
// by every 64 KiB segment (fewer wake-ups, context switches and readv calls
// when the sender outpaces it); it sets it back to one byte before it reads
// a header, so a last frame never waits for bytes that will not come. A frame for an unknown or ended tag is read
// into a small per-connection scratch buffer and dropped. A malformed frame closes that connection
// (transport.ErrProtocol) and nothing else. A receipt completes when all its
// bytes have arrived; an ABORT frame fails it with transport.ErrAborted.
//
// # Cancel
//
// Send: when ctx ends, the streams stop before their next frame, a frame
// being written gets a grace of one second (then its connection, whose byte
// stream is now corrupt, is closed and dropped from the pool, and a later
// Send redials), an ABORT for the tag is written, and Send returns an error
// wrapping ctx.Err() (a *transport.TimeoutError for a deadline). An ABORT
// that no connection takes within the grace (a receiver that stalls with
// its buffers full, or does not answer a dial) is left to one goroutine per
// receiver, which writes the ABORTs it holds on a connection of their own
// once the receiver answers, for up to 30 seconds, and drops them when the
// receiver refuses the connection or the Transport closes; the receipt's
// owner ends a receipt whose ABORT never came at its own deadline.
//
// Recv.Cancel: the receipt ends with transport.ErrCanceled; a reader in the
// middle of one of its frames is interrupted (a read deadline in the past),
// stops writing into dst after the Read in progress and drops the rest of
// the frame, so the connection survives. Cancel returns when no reader
// writes into dst any more; a reader that does not let go within a second
// has its connection closed. The sender is not told: its frames are dropped
// and its Send succeeds. Telling it is the control plane's business.
//
// # Connection failure
//
// Connections from one sending Transport form a session. A receipt is bound
// to the session of its first frame (frames for it from another session fail
// it with ErrProtocol). The receipts of a session fail with
// transport.ErrPeerLost when
//   - a connection breaks in the middle of one of their frames (that receipt);
//   - a connection of the session breaks other than by a clean end between
//     frames, such as a reset or a protocol error, since bytes of any of them
//     may have been lost with it (every receipt bound to the session);
//   - the last connection of the session ends, however cleanly: nobody is
//     left to complete them (every receipt bound to the session).
//
// A receipt that has seen no frame is bound to nobody: if its sender never
// comes, the caller's deadline ends it (Cancel). A sending Transport that
// closes aborts its Sends in flight before it closes its connections.
//
// # Idle connections
//
// With transport.Options.IdleTimeout (default 5 minutes), a receiver closes
// an accepted connection that has carried no frame for that long, or whose
// frame stalls that long, so that connections a peer opened and forgot, or
// a local process holds open, give their places back; an idle end between
// frames is a clean end. The read deadline that bounds the wait is the one
// an interrupt replaces and restores (Recv.Cancel). A sender retires a
// pooled connection it has not used for 3/4 of its own IdleTimeout and dials
// anew when it next sends: with one setting on both ends, a receiver never
// closes a connection a sender is about to write to (a frame written as the
// receiver closes would be lost without an error, since Send does not wait
// for the receiver).
//
// On the sending side, every pooled connection has a goroutine that reads
// from it (receivers never write), so that a peer closing or resetting it is
// noticed at once: the connection is dropped from the pool and writes in
// progress on it fail with transport.ErrPeerLost.
package tcp
