// Package control keeps one rank's control connections: the ones it
// accepts (from generation ranks that pull from it) and the ones it dials
// (to context ranks it pulls from, cached per endpoint). It owns their
// sockets, their TLS, the Hello handshake in both directions, their
// handshake and idle timeouts, and one reader goroutine per connection
// that answers Pings itself and hands every other frame to a Handler. It knows frames and peers, never
// requests: what a frame means, and which backend a pair uses, is the
// transceiver's.
//
// # Ownership
//
// A Plane owns its listener (from New), every Conn it accepts or dials,
// and every goroutine it starts: the accept loop (Start), one reader per
// Conn, one connection attempt per endpoint being dialled. Close closes
// them all and returns once each of those goroutines has ended. A Conn is
// usable until it is lost: its Send then fails with ErrPeerLost, and the
// Plane calls Handler.Lost for it exactly once (also for an accepted
// Conn whose handshake failed, which the Handler has not seen before).
//
// # Concurrency
//
// Every method of Plane and Conn is safe for concurrent use. The Handler
// is called without any lock of the Plane held, so it may call back into
// the Plane (Conn, Dial's release, Send); Frame and Lost of one Conn are
// called from its reader goroutine, in order, never concurrently with each
// other; Busy is called from the reader too. A caller may hold its own
// lock while it calls Plane.Conn, Conn.Touch, Conn.ID or Conn.Peer (they
// take the Plane's lock, or none), but not while it calls Send, which may
// block up to writeTimeout on a peer that does not read.
//
// # Idleness
//
// An accepted Conn closes after Limits.IdleTimeout without a frame, a
// dialled one after 3/4 of it, so that with one setting across a cluster
// the dialler closes first and never sends on a connection its peer is
// closing. A Conn is not idle while a caller of Dial holds it (until its
// release) nor while the Handler reports it Busy; each Touch starts its
// idle time again. A dialled Conn found idle leaves the dial cache at
// once, so that no later Dial takes it.
//
// # Edge cases
//
// Concurrent Dials of one endpoint share one attempt and its result; a
// failed attempt is not cached; a cached Conn that has died is replaced by
// a new attempt. Dial after Close returns ErrClosed. A peer whose Hello has
// another protocol version gets a Refused (wire.RefusedVersion) and is
// closed; a dialled peer that answers Refused makes Dial fail with
// ErrRefused. An accepted connection that sends no Hello within
// Limits.HandshakeTimeout is closed and counted as refused
// ("handshake_timeout"). Timeouts are read deadlines on the machine's
// clock; tests run them under testing/synctest, on connections of an
// in-memory network (Config.Dial, Config.Listener), whose fake clock
// passes them without a real wait.
package control
