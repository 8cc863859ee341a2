package memnet

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// pair dials a fresh listener of a fresh network and accepts.
func pair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	n := New()
	l, err := n.Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	client, err = n.Dial(context.Background(), l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err = l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

func TestAddresses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, s := pair(t)
		if c.RemoteAddr().String() != s.LocalAddr().String() || s.RemoteAddr().String() != c.LocalAddr().String() {
			t.Fatalf("client %v->%v, server %v->%v", c.LocalAddr(), c.RemoteAddr(), s.LocalAddr(), s.RemoteAddr())
		}
		for _, a := range []net.Addr{c.LocalAddr(), c.RemoteAddr()} {
			ta, ok := a.(*net.TCPAddr)
			if !ok || !ta.IP.IsLoopback() || ta.Port == 0 {
				t.Errorf("address %#v, want a loopback TCP address with a port", a)
			}
		}
		if c.LocalAddr().String() == c.RemoteAddr().String() {
			t.Error("both ends have one address")
		}
	})
}

// TestStream: what one end writes, in any cut, the other reads in order,
// in both directions, then io.EOF after the writer closes.
func TestStream(t *testing.T) {
	for _, tc := range []struct {
		name         string
		total, write int
	}{
		{"one byte", 1, 1},
		{"small writes", 1000, 7},
		{"past the buffer", 3*BufferBytes + 5, 1 << 16},
		{"one write past the buffer", 2*BufferBytes + 1, 2*BufferBytes + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				c, s := pair(t)
				src := make([]byte, tc.total)
				for i := range src {
					src[i] = byte(i * 7)
				}
				for _, dir := range [][2]net.Conn{{c, s}, {s, c}} {
					w, r := dir[0], dir[1]
					errc := make(chan error, 1)
					go func() {
						for off := 0; off < len(src); off += tc.write {
							if _, err := w.Write(src[off:min(off+tc.write, len(src))]); err != nil {
								errc <- err
								return
							}
						}
						errc <- nil
					}()
					got := make([]byte, len(src))
					if _, err := io.ReadFull(r, got); err != nil {
						t.Fatal(err)
					}
					if err := <-errc; err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, src) {
						t.Fatal("read differs from written")
					}
				}
				c.Close()
				if n, err := s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
					t.Fatalf("read after the peer closed: %d, %v; want EOF", n, err)
				}
				if _, err := s.Write([]byte{1}); err == nil {
					t.Fatal("write to a closed peer succeeded")
				}
				if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
					t.Fatalf("read of a closed conn: %v, want net.ErrClosed", err)
				}
			})
		})
	}
}

// TestDeadlines: a read or a write that waits fails at its deadline on the
// bubble's clock, not a moment before; a deadline moved or cleared while
// one waits takes effect.
func TestDeadlines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c, s := pair(t)
		start := time.Now()
		c.SetReadDeadline(start.Add(time.Second))
		_, err := c.Read(make([]byte, 1))
		if !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != time.Second {
			t.Fatalf("read: %v after %v, want a timeout after 1s", err, time.Since(start))
		}
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read past the deadline: %v", err)
		}

		// Moved later, then cleared, while a read waits.
		start = time.Now()
		c.SetReadDeadline(start.Add(time.Second))
		done := make(chan error)
		go func() {
			_, err := c.Read(make([]byte, 1))
			done <- err
		}()
		synctest.Wait()
		c.SetReadDeadline(start.Add(3 * time.Second))
		time.Sleep(2 * time.Second)
		synctest.Wait()
		select {
		case err := <-done:
			t.Fatalf("read ended at the old deadline: %v", err)
		default:
		}
		c.SetReadDeadline(time.Time{})
		time.Sleep(time.Hour)
		s.Write([]byte{9})
		if err := <-done; err != nil {
			t.Fatalf("read with the deadline cleared: %v", err)
		}

		// A write waits while the peer's buffer is full, until its deadline.
		if _, err := c.Write(make([]byte, BufferBytes)); err != nil {
			t.Fatal(err)
		}
		start = time.Now()
		c.SetWriteDeadline(start.Add(500 * time.Millisecond))
		n, err := c.Write([]byte{1, 2})
		if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) || time.Since(start) != 500*time.Millisecond {
			t.Fatalf("write to a full buffer: %d, %v after %v", n, err, time.Since(start))
		}
	})
}

// TestBlockedIsDurable: goroutines waiting in Accept, Read and Write are
// durably blocked, so synctest.Wait returns and time moves.
func TestBlockedIsDurable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := New()
		l, err := n.Listen("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		accepted := make(chan net.Conn)
		go func() {
			c, err := l.Accept()
			if err == nil {
				accepted <- c
			}
			close(accepted)
		}()
		c, err := n.Dial(context.Background(), l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		s := <-accepted
		go c.Read(make([]byte, 1))
		c.Write(make([]byte, BufferBytes))
		go c.Write([]byte{1})
		go l.Accept()
		synctest.Wait()
		start := time.Now()
		time.Sleep(time.Minute)
		if time.Since(start) != time.Minute {
			t.Fatal("time did not move")
		}
		l.Close()
		c.Close()
		s.Close()
	})
}

// TestListenerClose: Close fails Accept, refuses new dials and closes the
// connections dialled but not accepted; Dial to nothing is refused;
// DialFrom dials from the host it is given.
func TestListenerClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := New()
		l, err := n.Listen("127.0.0.2")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		pending, err := n.Dial(context.Background(), addr)
		if err != nil {
			t.Fatal(err)
		}
		defer pending.Close()
		l.Close()
		l.Close()
		if _, err := l.Accept(); !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v", err)
		}
		if _, err := n.Dial(context.Background(), addr); !errors.Is(err, ErrRefused) {
			t.Errorf("Dial after Close: %v, want ErrRefused", err)
		}
		if _, err := pending.Read(make([]byte, 1)); err != io.EOF {
			t.Errorf("a connection never accepted reads %v, want EOF", err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := n.Dial(ctx, addr); !errors.Is(err, context.Canceled) {
			t.Errorf("Dial with an ended context: %v", err)
		}
		l2, _ := n.Listen("127.0.0.1")
		defer l2.Close()
		c, err := n.DialFrom(context.Background(), "127.0.0.9", l2.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := l2.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if got := s.RemoteAddr().(*net.TCPAddr).IP.String(); got != "127.0.0.9" {
			t.Errorf("DialFrom 127.0.0.9: the listener sees %s", got)
		}
		if _, err := n.DialFrom(context.Background(), "nohost", l2.Addr().String()); err == nil {
			t.Error("DialFrom a host name succeeded")
		}
		if _, err := n.Listen("localhost"); err == nil {
			t.Error("Listen at a host name succeeded")
		}
	})
}
