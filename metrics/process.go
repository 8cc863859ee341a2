package metrics

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// NewRegistry returns the registry of one worker or router: empty but for
// the Go runtime's and the process's collectors. It is never the global
// one.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// Handler serves the metrics of reg in Prometheus's exposition format
// (GET /metrics).
func Handler(reg prometheus.Gatherer) http.Handler {
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

// Router holds the metrics of a router.
type Router struct {
	HTTPRequests *prometheus.CounterVec   // kvxfer_http_requests_total{route,code}
	Upstream     *prometheus.CounterVec   // kvxfer_router_upstream_requests_total{role,result}
	Latency      *prometheus.HistogramVec // kvxfer_router_request_duration_seconds{route}
	Migrations   *prometheus.CounterVec   // kvxfer_router_migrations_total{result}
	Workers      *prometheus.GaugeVec     // kvxfer_router_workers{role,state}
}

// NewRouter creates a router's metrics and registers them on reg.
func NewRouter(reg prometheus.Registerer) *Router {
	r := &Router{
		HTTPRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_http_requests_total",
			Help: "HTTP requests served by the router, by route and status code."}, []string{"route", "code"}),
		Upstream: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_router_upstream_requests_total",
			Help: "Requests the router sent to workers, by server role and result (ok, http_error, connect_error, error)."}, []string{"role", "result"}),
		Latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvxfer_router_request_duration_seconds",
			Help: "Duration of routed requests until the answer (or its stream) ended.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}, []string{"route"}),
		Migrations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_router_migrations_total",
			Help: "Requests whose generation worker failed mid-request, by result: ok (migrated: another generation worker took the request over), failed (not migrated: the limit was reached, no worker could take it, or the stream could not be resumed; the client got an error)."}, []string{"result"}),
		Workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_router_workers",
			Help: "Workers the router routes to, by role (context, generation) and state: up (routable), down (marked down by the router after a failed request or probe; tried last and probed until it answers)."}, []string{"role", "state"}),
	}
	r.Migrations.WithLabelValues("ok")
	r.Migrations.WithLabelValues("failed")
	for _, role := range []string{"context", "generation"} {
		for _, st := range []string{"up", "down"} {
			r.Workers.WithLabelValues(role, st)
		}
	}
	reg.MustRegister(r.HTTPRequests, r.Upstream, r.Latency, r.Migrations, r.Workers)
	return r
}
