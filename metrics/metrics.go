package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Set holds the metrics of one worker or router.
type Set struct {
	TransferBytes    *prometheus.CounterVec   // kvxfer_transfer_bytes_total{backend,role}
	TransferDuration *prometheus.HistogramVec // kvxfer_transfer_duration_seconds{role}
	TransferDelay    *prometheus.HistogramVec // kvxfer_transfer_wait_seconds{role}
	Transfers        *prometheus.CounterVec   // kvxfer_transfers_total{role,result}
	InFlight         *prometheus.GaugeVec     // kvxfer_transfers_in_flight{role}
	TTFT             prometheus.Histogram     // kvxfer_time_to_first_token_seconds
	TPOT             prometheus.Histogram     // kvxfer_time_per_output_token_seconds
	HTTPRequests     *prometheus.CounterVec   // kvxfer_http_requests_total{route,code}
	reg              prometheus.Registerer
}

// New creates the metrics and registers them on reg.
func New(reg prometheus.Registerer) *Set {
	s := &Set{reg: reg}
	s.TransferBytes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_transfer_bytes_total",
		Help: "KV-cache bytes moved, by backend and role (context sends, generation receives)."}, []string{"backend", "role"})
	s.TransferDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvxfer_transfer_duration_seconds",
		Help:    "Time a rank spent moving one request's KV cache, from the first byte to the end.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2, 20)}, []string{"role"})
	s.TransferDelay = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvxfer_transfer_wait_seconds",
		Help:    "Time from a request entering the transceiver to its data starting to move (waiting for the peer).",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2, 20)}, []string{"role"})
	s.Transfers = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_transfers_total",
		Help: "Finished transfers of one rank, by role and result (ok, error, timeout, cancelled)."}, []string{"role", "result"})
	s.InFlight = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_transfers_in_flight",
		Help: "Transfers started and not yet finished, by role (per rank)."}, []string{"role"})
	s.TTFT = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvxfer_time_to_first_token_seconds",
		Help: "Time from a request's arrival to its first generated token.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)})
	s.TPOT = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvxfer_time_per_output_token_seconds",
		Help: "Mean time per output token after the first, per request.", Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16)})
	s.HTTPRequests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_http_requests_total",
		Help: "HTTP requests served, by route and status code."}, []string{"route", "code"})
	reg.MustRegister(s.TransferBytes, s.TransferDuration, s.TransferDelay, s.Transfers, s.InFlight, s.TTFT, s.TPOT, s.HTTPRequests)
	return s
}

// PoolStats is what a pool gauge reads.
type PoolStats struct{ Free, Cached, Pinned int }

// AddPool registers kvxfer_pool_blocks{rank,state} for one rank's pool,
// read from stats at scrape time.
func (s *Set) AddPool(rank int, stats func() PoolStats) {
	r := strconv.Itoa(rank)
	for _, st := range []struct {
		name string
		get  func(PoolStats) int
	}{{"free", func(p PoolStats) int { return p.Free }}, {"cached", func(p PoolStats) int { return p.Cached }}, {"pinned", func(p PoolStats) int { return p.Pinned }}} {
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvxfer_pool_blocks",
			Help: "KV pool blocks of a rank by state (free, cached for reuse, pinned by requests).", ConstLabels: prometheus.Labels{"rank": r, "state": st.name}},
			func() float64 { return float64(st.get(stats())) }))
	}
}

// AddGauge registers a gauge read at scrape time, for values the caller
// owns (staging bytes in use, peer connections by backend).
func (s *Set) AddGauge(name, help string, labels prometheus.Labels, get func() float64) {
	s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, get))
}
