// Package conn is what the connection-based backends (tcp, shm) do alike
// with their connections besides accepting them (internal/accept): what the
// end of a connection means (a protocol error of the peer, a broken
// connection, or a clean end), and the error a transfer gets when its peer
// is gone. It owns no connection and no goroutine.
package conn
