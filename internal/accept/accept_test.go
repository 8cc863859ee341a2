package accept

import (
	"bytes"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestBackoff: errors are retried after delays that double from 5 ms
// to 1 s, a connection resets the delay, and net.ErrClosed ends the loop.
func TestBackoff(t *testing.T) {
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
		Loop("test", log, make(chan struct{}), accept, handle)

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

// TestMaxDelay: the delay stops growing at a second.
func TestMaxDelay(t *testing.T) {
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
		Loop("test", slog.New(slog.DiscardHandler), make(chan struct{}), accept, func(int) bool { return true })
		if got := gaps[len(gaps)-1]; got != time.Second {
			t.Errorf("last delay %v, want 1s", got)
		}
	})
}

// TestStop: stop ends a wait, and handle ends the loop by returning
// false.
func TestStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		stop := make(chan struct{})
		ended := make(chan struct{})
		go func() {
			Loop("test", slog.New(slog.DiscardHandler), stop, func() (int, error) { return 0, errors.New("EMFILE") },
				func(int) bool { return true })
			close(ended)
		}()
		synctest.Wait()
		close(stop)
		synctest.Wait()
		select {
		case <-ended:
		default:
			t.Fatal("Loop did not end at stop")
		}
	})
	calls := 0
	Loop("test", slog.New(slog.DiscardHandler), nil, func() (int, error) { calls++; return calls, nil },
		func(c int) bool { return c < 3 })
	if calls != 3 {
		t.Errorf("%d accepts, want 3: handle's false ends the loop", calls)
	}
}
