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

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

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
