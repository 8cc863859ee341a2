package accept

import (
	"errors"
	"log/slog"
	"net"
	"time"
)

// Backoff bounds, as net/http's Server.Serve.
const (
	minDelay = 5 * time.Millisecond
	maxDelay = time.Second
)

// Loop calls accept until it fails with net.ErrClosed (the listener has
// closed), and hands every connection to handle, which starts serving it or
// refuses it, and reports whether to go on accepting. Any other error of
// accept is logged at Warn as "<name>: accept failed; retrying" and retried
// after a delay that doubles from 5 ms up to 1 s; a connection resets the
// delay. A close of stop ends such a wait, and Loop.
func Loop[C any](name string, log *slog.Logger, stop <-chan struct{}, accept func() (C, error), handle func(C) bool) {
	var delay time.Duration
	for {
		c, err := accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			delay = min(max(2*delay, minDelay), maxDelay)
			log.Warn(name+": accept failed; retrying", "err", err, "delay", delay)
			timer := time.NewTimer(delay)
			select {
			case <-timer.C:
			case <-stop:
				timer.Stop()
				return
			}
			continue
		}
		delay = 0
		if !handle(c) {
			return
		}
	}
}
