package cli

import (
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// httpFlags bound the connections of a verb's HTTP server.
type httpFlags struct{ lim serve.HTTPLimits }

func (h *httpFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.IntVar(&h.lim.MaxConns, "http-max-conns", serve.DefaultHTTPMaxConns,
		"HTTP connections kept open at most (active or idle); more are refused at once (-1: no bound)")
	f.IntVar(&h.lim.MaxConnsPerHost, "http-max-conns-per-host", serve.DefaultHTTPMaxConnsPerHost,
		"HTTP connections from one client IP kept open at most (-1: no bound)")
	f.DurationVar(&h.lim.IdleTimeout, "http-idle-timeout", serve.DefaultHTTPIdleTimeout,
		"close a keep-alive HTTP connection idle this long")
	f.DurationVar(&h.lim.WriteTimeout, "http-write-timeout", serve.DefaultHTTPWriteTimeout,
		"close an HTTP connection whose client takes no part of an answer (an event of a stream) for this long (-1s: no bound)")
	f.DurationVar(&h.lim.BodyTimeout, "http-body-timeout", serve.DefaultHTTPBodyTimeout,
		"answer 408 and close an HTTP connection whose request body has not all come this long after its headers (-1s: no bound)")
	f.Int64Var(&h.lim.BodyBudget, "http-body-budget", serve.DefaultHTTPBodyBudget,
		"bytes of request bodies being received at once, over all connections, past the first 64 KiB of each; a body that would go over it is answered 503 (-1: no bound)")
}
