package conn

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// Backoff bounds of Accept, as net/http's Server.Serve.
const (
	minDelay = 5 * time.Millisecond
	maxDelay = time.Second
)

// Accept calls accept until it fails with net.ErrClosed (the listener has
// closed), and hands every connection to handle, which starts serving it or
// refuses it, and reports whether to go on accepting. Any other error of
// accept (out of file descriptors and the like) is logged at Warn as
// "<name>: accept failed; retrying" and retried after a delay that doubles
// from 5 ms up to 1 s, instead of spinning; a connection resets the delay.
// A close of stop ends such a wait, and Accept.
func Accept[C any](name string, log *slog.Logger, stop <-chan struct{}, accept func() (C, error), handle func(C) bool) {
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

// LogEnd logs why the connection with remote ended, as "<name>: closing
// <what>" at Warn when the peer broke the protocol (transport.ErrProtocol),
// "<name>: <what> broke" at Debug when the connection broke, and not at all
// for a clean end between messages (io.EOF) or a local close
// (net.ErrClosed).
func LogEnd(log *slog.Logger, name, what, remote string, err error) {
	switch {
	case errors.Is(err, transport.ErrProtocol):
		log.Warn(name+": closing "+what, "remote", remote, "err", err)
	case !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed):
		log.Debug(name+": "+what+" broke", "remote", remote, "err", err)
	}
}

// PeerLost wraps cause as transport.ErrPeerLost of op ("receive from",
// "send to") with peer, for the backend name. A protocol error stays
// visible to errors.Is; any other cause is kept as text only, so that a
// local net.ErrClosed (a connection closed under its reader) is not
// mistaken for a closed Transport.
func PeerLost(name, op, peer string, cause error) error {
	if errors.Is(cause, transport.ErrProtocol) {
		return fmt.Errorf("%s: %s %s: %w: %w", name, op, peer, transport.ErrPeerLost, cause)
	}
	return fmt.Errorf("%s: %s %s: %w: %v", name, op, peer, transport.ErrPeerLost, cause)
}
