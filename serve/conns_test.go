package serve

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/metrics"
)

// TestControlConnMetrics: the worker's metrics count its transceiver's
// inbound control connections.
func TestControlConnMetrics(t *testing.T) {
	wc := &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1, KVCache: config.KVCache{TokensPerBlock: 16, MaxTokens: 1024}}
	ct, err := config.NewCacheTransceiver("tcp", 16, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	wc.CacheTransceiver = ct
	w, err := NewWorker(context.Background(), WorkerOptions{Role: RoleContext, Model: "tiny-gqa", Config: wc})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if w.Transceiver() == nil || len(w.Transceiver().Listeners()) == 0 {
		t.Fatal("a context worker without transceiver listeners")
	}
	open := func() float64 {
		return metricValue(t, w.Registry(), "kvxfer_connections_open", map[string]string{"listener": metrics.ListenerControl})
	}
	c, err := net.Dial("tcp", w.Transceiver().Endpoints()[0])
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "one open control connection", func() bool { return open() == 1 })
	c.Close()
	waitUntil(t, "no open control connection", func() bool { return open() == 0 })
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after 5s", what)
		}
	}
}
