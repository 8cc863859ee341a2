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
	Conns            *Conns                   // kvxfer_connections_*{listener}
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
	s.Conns = NewConns(reg)
	return s
}

// Listeners, as the connection metrics label them.
const (
	ListenerHTTP    = "http"    // a worker's or router's HTTP API
	ListenerControl = "control" // the transceiver's control listeners (inbound)
)

// Conns are the connection metrics of a process's listeners. Every method
// is safe for concurrent use.
type Conns struct {
	Open       *prometheus.GaugeVec   // kvxfer_connections_open{listener}
	Refused    *prometheus.CounterVec // kvxfer_connections_refused_total{listener,reason}
	IdleClosed *prometheus.CounterVec // kvxfer_connections_idle_closed_total{listener}
}

// NewConns creates the connection metrics and registers them on reg (New
// does for a worker; a router, which has no Set, calls it itself).
func NewConns(reg prometheus.Registerer) *Conns {
	c := &Conns{
		Open: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvxfer_connections_open",
			Help: "Open inbound connections, by listener (http, control), handshaking or not."}, []string{"listener"}),
		Refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_connections_refused_total",
			Help: "Inbound connections refused or dropped before their handshake, by listener and reason (max_conns, max_conns_per_host, handshake_timeout)."},
			[]string{"listener", "reason"}),
		IdleClosed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvxfer_connections_idle_closed_total",
			Help: "Inbound connections closed after their idle timeout, by listener."}, []string{"listener"}),
	}
	reg.MustRegister(c.Open, c.Refused, c.IdleClosed)
	return c
}

// Listener returns the observer of one listener's connections: it feeds
// Open and Refused (the methods of netlimit's and transceiver's observers).
func (c *Conns) Listener(name string) ConnObserver {
	return ConnObserver{open: c.Open.WithLabelValues(name), refused: c.Refused.MustCurryWith(prometheus.Labels{"listener": name}),
		idle: c.IdleClosed.WithLabelValues(name)}
}

// ConnObserver counts the connections of one listener.
type ConnObserver struct {
	open    prometheus.Gauge
	refused *prometheus.CounterVec
	idle    prometheus.Counter
}

// Opened counts an accepted connection.
func (o ConnObserver) Opened() { o.open.Inc() }

// Closed counts an accepted connection that was closed.
func (o ConnObserver) Closed() { o.open.Dec() }

// Refused counts a refused or dropped connection.
func (o ConnObserver) Refused(reason string) { o.refused.WithLabelValues(reason).Inc() }

// IdleClosed counts a connection closed for idleness.
func (o ConnObserver) IdleClosed() { o.idle.Inc() }

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

// AddTransceiver registers the gauges of a worker's transceiver, read at
// scrape time: kvxfer_staging_buffer_bytes_in_use{role} from staging (the
// bytes of the send and receive staging buffers taken by transfers) and
// kvxfer_peer_connections{backend="control"} from control (open control
// connections to peer ranks).
func (s *Set) AddTransceiver(staging func() (send, recv int64), control func() int) {
	const stagingHelp = "Staging buffer bytes taken by transfers, by role (send, recv)."
	s.AddGauge("kvxfer_staging_buffer_bytes_in_use", stagingHelp,
		prometheus.Labels{"role": "send"}, func() float64 { send, _ := staging(); return float64(send) })
	s.AddGauge("kvxfer_staging_buffer_bytes_in_use", stagingHelp,
		prometheus.Labels{"role": "recv"}, func() float64 { _, recv := staging(); return float64(recv) })
	s.AddGauge("kvxfer_peer_connections", "Open control connections to peer ranks.",
		prometheus.Labels{"backend": "control"}, func() float64 { return float64(control()) })
}
