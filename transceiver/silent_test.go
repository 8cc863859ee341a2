package transceiver

import (
	"net"
	"sync"
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
func silentOn(t *testing.T, ln net.Listener) string { return serveOn(t, ln, nil) }

// serveOn accepts connections on ln and runs handle on each (nil: leaves
// it silent) until the test ends, when it closes them and waits for the
// handlers; it returns ln's address.
func serveOn(t *testing.T, ln net.Listener, handle func(net.Conn)) string {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			if handle != nil {
				wg.Go(func() { handle(c) })
			}
		}
	})
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}
