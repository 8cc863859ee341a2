package control

import (
	"context"
	"crypto/tls"
	"errors"
	"net"

	"github.com/kvxfer/kvxfer/internal/netlimit"
)

// Mutual TLS of the control plane (Config.TLSServer, Config.TLSClient).
// The context rank's listener makes every accepted connection a TLS server
// connection that requires a client certificate of the cluster CA; the
// generation rank
// dials with the client config and checks the context rank's certificate
// against the CA and the host of its endpoint. The handshake of an
// accepted connection runs on its first read, in the connection's own
// goroutine, within the hello's deadline.

// tlsListener wraps a control listener with TLS.
type tlsListener struct {
	net.Listener
	cfg *tls.Config
	log *netlimit.RateLog // the refused handshakes: anyone can cause one per connection
}

// Accept returns the next connection as a TLS server connection; the
// handshake has not run yet.
func (l *tlsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &tlsConn{Conn: tls.Server(c, l.cfg), raw: c, log: l.log}, nil
}

// tlsConn is a TLS control connection. Close closes the TCP connection at
// once instead of first writing a close_notify alert, which crypto/tls
// waits up to 5 s for when the peer does not read; the peer sees the end of
// the stream at a record boundary, as over plain TCP.
type tlsConn struct {
	*tls.Conn
	raw net.Conn
	// Server side: log, and the first Read runs the handshake and logs a
	// refused one, at most once a second with the count of those left
	// out (a stranger pays a connection for each). shook is touched only
	// by the connection's reader.
	log   *netlimit.RateLog
	shook bool
}

// Read reads from the TLS connection, running the handshake first on the
// server side.
func (c *tlsConn) Read(p []byte) (int, error) {
	if c.log != nil && !c.shook {
		c.shook = true
		if err := c.Conn.Handshake(); err != nil {
			if !errors.Is(err, net.ErrClosed) {
				c.log.Warn("tls handshake", "transceiver: refused a control connection: TLS handshake failed",
					"remote", c.raw.RemoteAddr().String(), "err", err)
			}
			return 0, err
		}
	}
	return c.Conn.Read(p)
}

// Close closes the TCP connection.
func (c *tlsConn) Close() error { return c.raw.Close() }

// dialTLS runs the client side of the handshake on c within ctx; on
// failure it closes c.
func dialTLS(ctx context.Context, c net.Conn, cfg *tls.Config, endpoint string) (net.Conn, error) {
	if cfg.ServerName == "" {
		cfg = cfg.Clone()
		cfg.ServerName, _, _ = net.SplitHostPort(endpoint)
	}
	tc := tls.Client(c, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return &tlsConn{Conn: tc, raw: c}, nil
}
