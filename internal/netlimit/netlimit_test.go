package netlimit

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type countObs struct{ opened, closed, refusedTotal, refusedHost atomic.Int64 }

func (o *countObs) Opened() { o.opened.Add(1) }
func (o *countObs) Closed() { o.closed.Add(1) }
func (o *countObs) Refused(reason string) {
	switch reason {
	case ReasonMaxConns:
		o.refusedTotal.Add(1)
	case ReasonMaxConnsPerHost:
		o.refusedHost.Add(1)
	}
}

// server accepts on a limited listener and hands the accepted connections
// to the test.
type server struct {
	l     *Listener
	conns chan net.Conn
	done  chan struct{}
}

func newServer(t *testing.T, lim Limits, log *slog.Logger, obs Observer) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{l: NewListener(ln, "test", lim, log, obs), conns: make(chan net.Conn, 64), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			c, err := s.l.Accept()
			if err != nil {
				close(s.conns)
				return
			}
			s.conns <- c
		}
	}()
	t.Cleanup(func() {
		s.l.Close()
		<-s.done
		for c := range s.conns {
			c.Close()
		}
	})
	return s
}

// dial connects from local address from (an IP of 127.0.0.0/8); nil when
// the connection was reset before Dial returned (a refusal on loopback can
// be that fast).
func dial(t *testing.T, s *server, from string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", s.l.Addr().String())
	if errors.Is(err, syscall.ECONNRESET) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// refused reports whether the server closed c at once (a read ends).
func refused(t *testing.T, c net.Conn) bool {
	t.Helper()
	if c == nil {
		return true
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.Read(make([]byte, 1))
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
		return true
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("the server neither answered nor closed the connection")
	}
	return err != nil
}

func TestListenerCaps(t *testing.T) {
	obs := &countObs{}
	var logs syncbuf.Buffer
	s := newServer(t, Limits{MaxConns: 3, MaxConnsPerHost: 2}, slog.New(slog.NewTextHandler(&logs, nil)), obs)
	var accepted []net.Conn
	accept := func() net.Conn {
		t.Helper()
		select {
		case c := <-s.conns:
			accepted = append(accepted, c)
			return c
		case <-time.After(5 * time.Second):
			t.Fatal("nothing accepted")
			return nil
		}
	}
	dial(t, s, "127.0.0.1")
	dial(t, s, "127.0.0.1")
	accept()
	accept()
	// A third from the same host is refused; one from another host is not.
	if c := dial(t, s, "127.0.0.1"); !refused(t, c) {
		t.Fatal("a third connection from one host was served (per-host cap 2)")
	}
	dial(t, s, "127.0.0.2")
	accept()
	if got := s.l.Open(); got != 3 {
		t.Fatalf("Open() = %d, want 3", got)
	}
	// The total cap.
	if c := dial(t, s, "127.0.0.3"); !refused(t, c) {
		t.Fatal("a fourth connection was served (total cap 3)")
	}
	// Closing one frees a place.
	accepted[0].Close()
	accepted[0].Close() // idempotent: frees one place only
	dial(t, s, "127.0.0.1")
	accept()
	if got := s.l.Open(); got != 3 {
		t.Fatalf("Open() = %d after close and accept, want 3", got)
	}
	if o, c, rt, rh := obs.opened.Load(), obs.closed.Load(), obs.refusedTotal.Load(), obs.refusedHost.Load(); o != 4 || c != 1 || rt != 1 || rh != 1 {
		t.Errorf("observer: opened %d closed %d refused total %d per host %d, want 4 1 1 1", o, c, rt, rh)
	}
	out := logs.String()
	for _, want := range []string{"reason=max_conns_per_host", "reason=max_conns ", "listener=test", "limit=2", "limit=3"} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %q:\n%s", want, out)
		}
	}
	if Unwrap(accepted[1]) == accepted[1] {
		t.Error("Unwrap returned the wrapper")
	}
}

func TestListenerUnbounded(t *testing.T) {
	s := newServer(t, Limits{}, nil, nil)
	for range 20 {
		dial(t, s, "127.0.0.1")
	}
	for range 20 {
		select {
		case <-s.conns:
		case <-time.After(5 * time.Second):
			t.Fatal("a connection was not accepted without limits")
		}
	}
}

func TestRateLog(t *testing.T) {
	var logs syncbuf.Buffer
	rl := NewRateLog(slog.New(slog.NewTextHandler(&logs, nil)), time.Second)
	now := time.Unix(1000, 0)
	rl.now = func() time.Time { return now }
	for range 5 {
		rl.Warn("a", "refused", "reason", "a")
	}
	rl.Warn("b", "refused", "reason", "b")
	now = now.Add(time.Second)
	rl.Warn("a", "refused", "reason", "a")
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines, want 3 (a, b, a with suppressed=4):\n%s", len(lines), logs.String())
	}
	if strings.Contains(lines[0], "suppressed") || !strings.Contains(lines[2], "suppressed=4") {
		t.Errorf("suppressed counts wrong:\n%s", logs.String())
	}
	var zero *RateLog
	zero.Warn("x", "nothing") // must not panic
}

func TestLimitsString(t *testing.T) {
	for _, tc := range []struct {
		lim  Limits
		want string
	}{
		{Limits{MaxConns: 4096, MaxConnsPerHost: 1024}, "max 4096 connections, 1024 per host"},
		{Limits{}, "max unbounded connections, unbounded per host"},
	} {
		if got := tc.lim.String(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.lim, got, tc.want)
		}
	}
}

// TestRateLogBurst: a burst of 1,000 warnings of one cause is one line at
// once and one line at the end of the interval that counts the rest, even
// when no warning of that cause follows (issue #13: 82,206 lines in 30 s).
func TestRateLogBurst(t *testing.T) {
	var logs syncbuf.Buffer
	rl := NewRateLog(slog.New(slog.NewTextHandler(&logs, nil)), 50*time.Millisecond)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 250 {
				rl.Warn("unreachable", "worker unreachable", "url", "http://ctx0")
			}
		})
	}
	wg.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "suppressed=999") && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // nothing more comes
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], "suppressed=999") || !strings.Contains(lines[1], "url=http://ctx0") {
		t.Fatalf("%d lines, want 2 (the first, then one with suppressed=999):\n%s", len(lines), logs.String())
	}
}
