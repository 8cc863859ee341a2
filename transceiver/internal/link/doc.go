// Package link reaches the context rank a receive pulls from: the control
// connection to its endpoint (the live one the dial cache holds, or a new
// dial) and the data plane of the pair. The choice of that data plane is
// a pure function (chooseBackend) of the backend configured, of what both
// ranks announced in their Hellos and, for shm under AUTO, of whether this
// rank reaches the peer's shm endpoint: a probe run once per control
// connection, whose answer the connection keeps (control.Conn.Probe).
// Hello builds what a rank announces of itself, which the peer's choice
// reads.
//
// A Linker holds no goroutine of its own; Get runs on its caller's, Reach
// on its caller's or on the one its caller starts for it, and a probe
// either runs is bounded by a timeout and by the Linker's Close.
// Get is safe for concurrent use: concurrent Gets of one endpoint share
// one dial and one probe.
package link
