//go:build linux

package shm

import (
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// TestConnectionCap: any process of the host can connect to the abstract
// socket; connections that never say hello hold at most MaxConns places
// and the excess is closed at once.
func TestConnectionCap(t *testing.T) {
	tr := open(t, transport.Options{MaxConns: 2})
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("unix", tr.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	inbound := func() int {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		return len(tr.inbound)
	}
	waitInbound := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); inbound() != n; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d inbound connections, want %d", inbound(), n)
			}
		}
	}
	// closed reports whether the transport closed c within wait.
	closed := func(c net.Conn, wait time.Duration) bool {
		c.SetReadDeadline(time.Now().Add(wait))
		_, err := c.Read(make([]byte, 1))
		return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
	}
	a, b := dial(), dial()
	waitInbound(2)
	if c := dial(); !closed(c, 5*time.Second) {
		t.Fatal("a third connection was kept (cap 2)")
	}
	if closed(a, 50*time.Millisecond) || closed(b, 50*time.Millisecond) {
		t.Fatal("a connection within the cap was closed")
	}
	a.Close()
	waitInbound(1)
	if c := dial(); closed(c, 50*time.Millisecond) {
		t.Fatal("a connection was refused after a place was freed")
	}
}
