//go:build linux

package shm

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
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

// TestProtocolErrorFloodLogBounded: any process of the host can connect to
// the abstract socket and write junk; each such connection is closed for
// breaking the protocol, but buys no warning of its own: the closes are
// logged a line a second with the count left out, and the receiver still
// takes a genuine transfer.
func TestProtocolErrorFloodLogBounded(t *testing.T) {
	const flood = 200
	var logs syncbuf.Buffer
	a := open(t, transport.Options{})
	b := open(t, transport.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	for i := range flood {
		c, err := net.Dial("unix", b.Endpoint())
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
		_, err = io.Copy(io.Discard, c) // until b closes it: logged by then
		c.Close()
		if err != nil {
			t.Fatalf("connection %d: not closed by the receiver: %v", i, err)
		}
	}
	if n := strings.Count(logs.String(), "closing connection"); n == 0 || n > 3 {
		t.Errorf("%d log lines for %d connections closed for protocol errors, want 1 to 3", n, flood)
	}
	healthy(t, a, b, shared(t, 1<<20, a))
}
