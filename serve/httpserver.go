package serve

import (
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/metrics"
)

// Defaults of HTTPLimits. A worker's clients are routers (one connection
// per request in flight, so the per-host bound is a router's concurrency
// against one worker) and the odd direct client; a router's are users.
const (
	DefaultHTTPMaxConns          = 4096
	DefaultHTTPMaxConnsPerHost   = 1024
	DefaultHTTPIdleTimeout       = 2 * time.Minute
	DefaultHTTPReadHeaderTimeout = 10 * time.Second
)

// HTTPLimits bound the connections of a worker's or router's HTTP server. A
// zero field takes its default; a negative one removes the bound.
type HTTPLimits struct {
	// MaxConns bounds the open connections (active or idle keep-alive);
	// one more is closed at once.
	MaxConns int
	// MaxConnsPerHost bounds those from one client IP address.
	MaxConnsPerHost int
	// IdleTimeout closes a keep-alive connection idle this long.
	IdleTimeout time.Duration
	// ReadHeaderTimeout bounds the reading of a request's headers.
	ReadHeaderTimeout time.Duration
}

// WithDefaults returns l with zero fields set to their defaults.
func (l HTTPLimits) WithDefaults() HTTPLimits {
	if l.MaxConns == 0 {
		l.MaxConns = DefaultHTTPMaxConns
	}
	if l.MaxConnsPerHost == 0 {
		l.MaxConnsPerHost = DefaultHTTPMaxConnsPerHost
	}
	if l.IdleTimeout == 0 {
		l.IdleTimeout = DefaultHTTPIdleTimeout
	}
	if l.ReadHeaderTimeout == 0 {
		l.ReadHeaderTimeout = DefaultHTTPReadHeaderTimeout
	}
	return l
}

// String describes l for logs: "max 4096 connections, 1024 per host, idle
// timeout 2m0s".
func (l HTTPLimits) String() string {
	return netlimit.Limits{MaxConns: l.MaxConns, MaxConnsPerHost: l.MaxConnsPerHost}.String() + ", idle timeout " + l.IdleTimeout.String()
}

// NewHTTPServer returns a server of h with the timeouts of lim (after
// WithDefaults). Serve it on a listener from LimitListener.
func NewHTTPServer(h http.Handler, lim HTTPLimits) *http.Server {
	lim = lim.WithDefaults()
	return &http.Server{Handler: h, ReadHeaderTimeout: max(0, lim.ReadHeaderTimeout), IdleTimeout: max(0, lim.IdleTimeout)}
}

// LimitListener wraps ln so that it keeps at most lim's connections (after
// WithDefaults), refusing the excess at once with a rate-limited log line
// on log. name says which server it is in logs; conns, when not nil,
// counts its connections (kvxfer_connections_*{listener="http"}).
func LimitListener(ln net.Listener, name string, lim HTTPLimits, log *slog.Logger, conns *metrics.Conns) net.Listener {
	lim = lim.WithDefaults()
	var obs netlimit.Observer
	if conns != nil {
		obs = conns.Listener(metrics.ListenerHTTP)
	}
	return netlimit.NewListener(ln, name, netlimit.Limits{MaxConns: lim.MaxConns, MaxConnsPerHost: lim.MaxConnsPerHost}, log, obs)
}
