// Package conn is what the connection-based backends (tcp, shm) do alike
// with their connections: the accept loop that backs off on errors instead
// of spinning, what the end of a connection means (a protocol error of the
// peer, a broken connection, or a clean end), and the error a transfer gets
// when its peer is gone. It owns no connection and no goroutine: Accept runs
// on the caller's.
//
// Accept is generic over the connection type, so that the transceiver's
// control listener, which runs the same loop, could use it too.
package conn
