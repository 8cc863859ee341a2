package serve

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"strings"
)

// Mutual TLS between the router and the workers (see the package
// documentation): a worker started with TLS serves HTTPS and requires a
// client certificate of the cluster CA on every route, /health and
// /metrics included; the router and the launcher dial the workers with
// their own certificate of that CA. The router's client-facing listener
// stays plain HTTP: its clients hold no cluster certificate (put a
// TLS-terminating proxy in front of it for a public endpoint).

// upstreamURL normalizes a worker URL: without a scheme it gets https://
// when the router talks TLS to the workers and http:// otherwise. An http://
// URL with TLS on is refused: it would send requests, and the handoff
// state in them, in clear to a worker that only speaks TLS.
func upstreamURL(u string, tlsOn bool) (string, error) {
	switch {
	case strings.HasPrefix(u, "https://"):
	case strings.HasPrefix(u, "http://"):
		if tlsOn {
			return "", fmt.Errorf("serve: worker URL %q is plain http, but the router talks TLS to its workers (write https:// or no scheme)", u)
		}
	case tlsOn:
		u = "https://" + u
	default:
		u = "http://" + u
	}
	return strings.TrimRight(u, "/"), nil
}

// NewHTTPClient returns a client for talking to workers: plain, or with
// mutual TLS when tc (a client config) is set. Its transport keeps up to 64
// idle connections per worker and waits at most 10 minutes for an answer's
// headers (a long prefill). It follows no redirect: a worker's 3xx is its
// answer (which the router refuses), so a Location never decides where a
// client's prompt goes.
func NewHTTPClient(tc *tls.Config) *http.Client {
	return &http.Client{Transport: newUpstreamTransport(tc),
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}
