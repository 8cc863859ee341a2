package conn

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"

	"github.com/kvxfer/kvxfer/transport"
)

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
