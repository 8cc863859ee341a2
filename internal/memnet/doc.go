// Package memnet is an in-memory network for tests of code that listens and
// dials over TCP: listeners, and connections made of two buffered pipes,
// whose every wait is on a channel. Inside a testing/synctest bubble a
// goroutine blocked in Accept, Read, Write or Dial is therefore durably
// blocked, so fake time advances while it waits, which it does not while a
// goroutine waits on a real socket (the runtime's poller is outside the
// bubble). Deadlines are timers of the caller's time: fake in a bubble.
//
// A Network, its listeners and connections must be made inside the bubble
// that uses them (channels belong to the bubble that made them).
//
// What it does not do: model a socket's latency, its bandwidth, a network
// that loses or reorders data, or ports beyond a counter. Addresses are TCP
// addresses of the host the listener was asked for, so that code checking
// a peer's address (loopback, allowed hosts) sees what it would over TCP.
// It is test support; nothing in a production path uses it.
package memnet
