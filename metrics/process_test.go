package metrics

import (
	"io"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestRouterAndRegistry: a router's metrics and a worker's transceiver
// gauges land on their registries, next to the Go and process collectors,
// and the handler serves them.
func TestRouterAndRegistry(t *testing.T) {
	rreg, wreg := NewRegistry(), NewRegistry()
	r := NewRouter(rreg)
	r.HTTPRequests.WithLabelValues("/v1/completions", "200").Inc()
	r.Upstream.WithLabelValues("context", "ok").Add(2)
	r.Latency.WithLabelValues("/v1/completions").Observe(0.01)
	New(wreg).AddTransceiver(func() (int64, int64) { return 3, 5 }, func() int { return 7 })
	for _, tc := range []struct {
		reg    *prometheus.Registry
		name   string
		labels map[string]string
		want   float64
	}{
		{rreg, "kvxfer_http_requests_total", map[string]string{"route": "/v1/completions", "code": "200"}, 1},
		{rreg, "kvxfer_router_upstream_requests_total", map[string]string{"role": "context", "result": "ok"}, 2},
		// Both results are there from the start, at 0 until a migration.
		{rreg, "kvxfer_router_migrations_total", map[string]string{"result": "ok"}, 0},
		{rreg, "kvxfer_router_migrations_total", map[string]string{"result": "failed"}, 0},
		{wreg, "kvxfer_staging_buffer_bytes_in_use", map[string]string{"role": "send"}, 3},
		{wreg, "kvxfer_staging_buffer_bytes_in_use", map[string]string{"role": "recv"}, 5},
		{wreg, "kvxfer_peer_connections", map[string]string{"backend": "control"}, 7},
	} {
		if got, ok := value(t, tc.reg, tc.name, tc.labels); !ok || got != tc.want {
			t.Errorf("%s%v = %v (present %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	rec := httptest.NewRecorder()
	Handler(rreg).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	for _, want := range []string{"kvxfer_router_request_duration_seconds_count", "go_goroutines", "process_"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// TestScrapeReleasesFiles: the process collector reads /proc at every
// scrape; the files it opens are closed again, so a scraped process does
// not run out of descriptors.
func TestScrapeReleasesFiles(t *testing.T) {
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		t.Skip("needs Linux's /proc/self/fd")
	}
	h := Handler(NewRegistry())
	scrape := func() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		if !strings.Contains(rec.Body.String(), "process_open_fds") {
			t.Fatalf("scrape without process_open_fds: %.200s", rec.Body.String())
		}
	}
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	scrape() // whatever the first scrape sets up for good
	before := fds()
	for range 20 {
		scrape()
	}
	if after := fds(); after != before {
		t.Errorf("%d open descriptors after 20 scrapes, %d before", after, before)
	}
}
