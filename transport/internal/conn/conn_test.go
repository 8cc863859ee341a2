package conn

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestAcceptBackoff: errors are retried after delays that double from 5 ms
// to 1 s, a connection resets the delay, and net.ErrClosed ends the loop.
func TestAcceptBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// 8 errors, a connection, 2 errors, a connection, the end.
		script := []error{}
		for range 8 {
			script = append(script, errors.New("too many open files"))
		}
		script = append(script, nil, errors.New("again"), errors.New("again"), nil, net.ErrClosed)
		var at []time.Duration
		var handled []time.Duration
		start := time.Now()
		i := 0
		accept := func() (int, error) {
			at = append(at, time.Since(start))
			err := script[i]
			i++
			return i, err
		}
		handle := func(int) bool { handled = append(handled, time.Since(start)); return true }
		var logs bytes.Buffer
		log := slog.New(slog.NewTextHandler(&logs, nil))
		Accept("test", log, make(chan struct{}), accept, handle)

		ms := time.Millisecond
		wantGaps := []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms, 320 * ms, 640 * ms, 0, 5 * ms, 10 * ms, 0}
		for k := 1; k < len(at); k++ {
			if gap := at[k] - at[k-1]; gap != wantGaps[k-1] {
				t.Errorf("accept %d came %v after the one before, want %v", k, gap, wantGaps[k-1])
			}
		}
		if i != len(script) || len(handled) != 2 {
			t.Errorf("%d accepts, %d handled; want %d and 2", i, len(handled), len(script))
		}
		if n := strings.Count(logs.String(), "test: accept failed; retrying"); n != 10 {
			t.Errorf("%d warnings, want 10:\n%s", n, logs.String())
		}
	})
}

// TestAcceptMaxDelay: the delay stops growing at a second.
func TestAcceptMaxDelay(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var last time.Time
		var gaps []time.Duration
		n := 0
		accept := func() (int, error) {
			now := time.Now()
			if n > 0 {
				gaps = append(gaps, now.Sub(last))
			}
			last = now
			if n++; n > 12 {
				return 0, net.ErrClosed
			}
			return 0, errors.New("EMFILE")
		}
		Accept("test", slog.New(slog.DiscardHandler), make(chan struct{}), accept, func(int) bool { return true })
		if got := gaps[len(gaps)-1]; got != time.Second {
			t.Errorf("last delay %v, want 1s", got)
		}
	})
}

// TestAcceptStop: stop ends a wait, and handle ends the loop by returning
// false.
func TestAcceptStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		stop := make(chan struct{})
		ended := make(chan struct{})
		go func() {
			Accept("test", slog.New(slog.DiscardHandler), stop, func() (int, error) { return 0, errors.New("EMFILE") },
				func(int) bool { return true })
			close(ended)
		}()
		synctest.Wait()
		close(stop)
		synctest.Wait()
		select {
		case <-ended:
		default:
			t.Fatal("Accept did not end at stop")
		}
	})
	calls := 0
	Accept("test", slog.New(slog.DiscardHandler), nil, func() (int, error) { calls++; return calls, nil },
		func(c int) bool { return c < 3 })
	if calls != 3 {
		t.Errorf("%d accepts, want 3: handle's false ends the loop", calls)
	}
}

func TestLogEnd(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want string // "" for nothing
	}{
		{io.EOF, ""},
		{fmt.Errorf("read: %w", net.ErrClosed), ""},
		{fmt.Errorf("%w: bad frame", transport.ErrProtocol), "level=WARN msg=\"test: closing data connection\""},
		{io.ErrUnexpectedEOF, "level=DEBUG msg=\"test: data connection broke\""},
	} {
		var buf bytes.Buffer
		log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
		LogEnd(log, "test", "data connection", "1.2.3.4:5", tt.err)
		got := buf.String()
		if tt.want == "" && got != "" || tt.want != "" && (!strings.Contains(got, tt.want) || !strings.Contains(got, "remote=1.2.3.4:5")) {
			t.Errorf("LogEnd(%v) logged %q, want %q", tt.err, got, tt.want)
		}
	}
}

func TestPeerLost(t *testing.T) {
	proto := fmt.Errorf("%w: bad frame", transport.ErrProtocol)
	err := PeerLost("tcp", "receive from", "1.2.3.4:5", proto)
	if !errors.Is(err, transport.ErrPeerLost) || !errors.Is(err, transport.ErrProtocol) {
		t.Errorf("%v: want ErrPeerLost and ErrProtocol", err)
	}
	if want := "tcp: receive from 1.2.3.4:5: transport: peer lost: transport: protocol error: bad frame"; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
	err = PeerLost("shm", "send to", "@x", fmt.Errorf("write: %w", net.ErrClosed))
	if !errors.Is(err, transport.ErrPeerLost) || errors.Is(err, net.ErrClosed) {
		t.Errorf("%v: want ErrPeerLost, and a local close not visible", err)
	}
}
