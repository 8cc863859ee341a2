package transceiver

import (
	"context"
	"net"

	"github.com/kvxfer/kvxfer/transport"
)

// network is where a rank listens for control connections, dials its
// control peers and opens its data planes. The machine's is the only one
// outside tests; tests inject an in-memory one (Options.network).
type network interface {
	// Listen listens on host, on a port of the network's choice.
	Listen(ctx context.Context, host string) (net.Listener, error)
	// Dial connects to a control endpoint (host:port).
	Dial(ctx context.Context, endpoint string) (net.Conn, error)
	// OpenData opens the named data plane (transport.Open).
	OpenData(ctx context.Context, name string, o transport.Options) (transport.Transport, error)
}

// hostNetwork is the machine's network: TCP, the registered backends.
type hostNetwork struct{}

func (hostNetwork) Listen(ctx context.Context, host string) (net.Listener, error) {
	var lc net.ListenConfig
	return lc.Listen(ctx, "tcp", net.JoinHostPort(host, "0"))
}

func (hostNetwork) Dial(ctx context.Context, endpoint string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", endpoint)
}

func (hostNetwork) OpenData(ctx context.Context, name string, o transport.Options) (transport.Transport, error) {
	return transport.Open(ctx, name, o)
}
