// Package accept is the accept loop of kvxfer's listeners: it hands each
// connection to its server and, on an accept error that is not the end of
// the listener (out of file descriptors and the like), backs off as
// net/http does instead of spinning. It owns no listener and starts no
// goroutine: Loop runs on the caller's.
//
// It is generic over the connection type (net.Conn, *net.UnixConn...) and
// lets the handler end the loop, so that every listener of the module can
// use it: the tcp and shm data planes do; the transceiver's control
// listener runs a copy of it still.
package accept
