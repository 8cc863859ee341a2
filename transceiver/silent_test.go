package transceiver

import (
	"net"
	"testing"
)

// newSilentListener accepts connections on nw and never writes: a peer
// that hangs.
func newSilentListener(t *testing.T, nw *memNetwork) string {
	ln, err := nw.Listen(t.Context(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return silentOn(t, ln)
}

// silentOn accepts connections on ln and neither reads nor writes, until
// the test ends; it returns ln's address.
func silentOn(t *testing.T, ln net.Listener) string {
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}
