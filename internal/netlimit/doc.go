// Package netlimit bounds the connections a listener keeps open, for every
// listener of kvxfer (worker and router HTTP, transceiver control, tcp
// data): a total cap and a per-remote-host cap on simultaneous connections,
// enforced at accept (an excess connection is closed at once, never
// queued), and a log of refusals that is rate-limited so that a flood
// cannot flood the log too.
//
// It owns counting and refusing. Timeouts stay with the protocol that knows
// what a handshake or an idle connection is (http.Server's IdleTimeout, the
// control plane's hello and idle timeouts). It starts no goroutine.
package netlimit
