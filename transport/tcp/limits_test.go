package tcp

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/transport"
)

// TestConnectionCaps: connections that never send a preface hold at most
// MaxConnsPerHost places per host and MaxConns in all; the excess is closed
// at once, and a sender from another host still delivers.
func TestConnectionCaps(t *testing.T) {
	b := open(t, transport.Options{MaxConns: 3, MaxConnsPerHost: 2})
	a := open(t, transport.Options{Streams: 1})
	// hostile connects from address from; nil when the connection was
	// reset before Dial returned (a refusal on loopback can be that fast).
	hostile := func(from string) net.Conn {
		t.Helper()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		c, err := d.Dial("tcp", b.Endpoint())
		if errors.Is(err, syscall.ECONNRESET) {
			return nil
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	var held []net.Conn
	for range 2 {
		held = append(held, hostile("127.0.0.2"))
	}
	eventually(t, "two silent connections accepted", func() bool { n, _ := b.inboundCounts(); return n == 2 })
	if c := hostile("127.0.0.2"); c != nil && !closedByPeer(c) {
		t.Fatal("a third connection from one host was kept (per-host cap 2)")
	}
	for _, c := range held {
		if !openByPeer(c) {
			t.Fatal("a connection within the caps was closed")
		}
	}
	// The sender dials from 127.0.0.1: its one stream takes the last place.
	move(t, a, b, [][]byte{seq(1<<20, 1)}, [][]byte{make([]byte, 1<<20)})
	if c := hostile("127.0.0.3"); c != nil && !closedByPeer(c) {
		t.Fatal("a fourth connection was kept (total cap 3)")
	}
	// Freed places are taken again.
	held[0].Close()
	eventually(t, "a closed connection's place freed", func() bool { n, _ := b.inboundCounts(); return n == 2 })
	if c := hostile("127.0.0.3"); c == nil || !openByPeer(c) {
		t.Fatal("a connection was refused after a place was freed")
	}
	move(t, a, b, [][]byte{seq(4096, 2)}, [][]byte{make([]byte, 4096)})
}

// TestCloseFloodLogBounded: any process that reaches the data listener can
// open connections that break the protocol (a bad preface, a malformed
// frame) or fail the TLS handshake; each is closed, but buys no warning of
// its own: such closes are logged a line a second per cause with the count
// left out, and the receiver still takes a genuine transfer.
func TestCloseFloodLogBounded(t *testing.T) {
	const flood = 200
	ca := testCA()
	for _, tc := range []struct {
		name string
		tls  bool
		line string
	}{
		{"protocol", false, "closing data connection"},
		{"TLS", true, "TLS handshake failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs syncbuf.Buffer
			opts := transport.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}
			aOpts := transport.Options{}
			if tc.tls {
				opts.TLS, aOpts.TLS = party(t, ca, "rx"), party(t, ca, "tx")
			}
			b := open(t, opts)
			a := open(t, aOpts)
			for i := range flood {
				c, err := net.Dial("tcp", b.Endpoint())
				if err != nil {
					t.Fatalf("connection %d: %v", i, err)
				}
				c.SetDeadline(time.Now().Add(5 * time.Second))
				c.Write([]byte(strings.Repeat("GET / HTTP/1.0\r\n\r\n", prefaceLen)[:prefaceLen]))
				_, err = io.Copy(io.Discard, c) // until b closes it: logged by then
				c.Close()
				if err != nil && !errors.Is(err, syscall.ECONNRESET) {
					t.Fatalf("connection %d: not closed by the receiver: %v", i, err)
				}
			}
			if n := strings.Count(logs.String(), tc.line); n == 0 || n > 3 {
				t.Errorf("%d log lines %q for %d connections closed, want 1 to 3", n, tc.line, flood)
			}
			move(t, a, b, [][]byte{seq(1<<20, 3)}, [][]byte{make([]byte, 1<<20)})
		})
	}
}
