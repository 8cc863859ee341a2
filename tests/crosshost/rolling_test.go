package crosshost

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestRollingRestart: 2 context + 2 generation workers on loopback with
// the router's built-in store, under 16 concurrent clients; each worker in
// turn is SIGTERMed (a graceful leave), waited for and started again on
// its port, and the next one only once the new one takes traffic. Every
// answer is compared with the aggregated worker's; the target is 0 failed
// requests. Needs no network namespace.
func TestRollingRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level: a router and five workers")
	}
	dir := t.TempDir()
	ps := newProcs(t, "KVXFER_CLUSTER_SECRET=7c3f0a5e9d1b2c4e6f8a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4")
	client := &http.Client{Timeout: reqDeadline + 5*time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	t.Cleanup(client.CloseIdleConnections)
	rport := freePort(t)
	router := fmt.Sprintf("http://127.0.0.1:%d", rport)
	dc := fmt.Sprintf("disagg_cluster:\n  cluster_uri: %q\n  cluster_name: rolling\n  minimal_instances: {context_servers: 1, generation_servers: 1}\n"+
		"  heartbeat_interval_sec: 1\n  inactive_timeout_sec: 3\n", router)
	cy, wy, ay := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "worker.yaml"), filepath.Join(dir, "aggregated.yaml")
	os.WriteFile(cy, fmt.Appendf(nil, "hostname: 127.0.0.1\nport: %d\n%s", rport, dc), 0o600)
	kv := "kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}\n"
	os.WriteFile(wy, []byte(kv+"cache_transceiver_config: {backend: DEFAULT, kv_transfer_timeout_ms: 5000}\n"+dc), 0o600)
	os.WriteFile(ay, []byte(kv), 0o600)
	ps.start("router", "", "", "router", "--config", cy, "--admin-addr", "", "--probe-interval", "100ms")

	cl := &cluster{t: t, client: client, wantIDs: map[int][]int32{}}
	aport := freePort(t)
	agg := ps.start("aggregated", "", "", "serve", "--role", "both", "--host", "127.0.0.1", "--port", fmt.Sprint(aport), "--admin-addr", "", "--config", ay)
	agg.url = fmt.Sprintf("http://127.0.0.1:%d", aport)
	cl.waitHealthy(agg)
	cl.aggURL = agg.url
	const prompts = 16 // distinct prompts, so the aggregated answers are few
	for i := range prompts {
		cl.want(i)
	}

	type slot struct {
		name, role string
		port       int
		p          *proc
	}
	slots := []*slot{{name: "context-0", role: "context"}, {name: "context-1", role: "context"}, {name: "generation-0", role: "generation"}, {name: "generation-1", role: "generation"}}
	start := func(s *slot, gen int) {
		s.p = ps.start(fmt.Sprintf("%s.%d", s.name, gen), "", "", "serve", "--role", s.role, "--config", wy, "--host", "127.0.0.1",
			"--port", fmt.Sprint(s.port), "--admin-addr", "")
		s.p.url = fmt.Sprintf("http://127.0.0.1:%d", s.port)
	}
	urls := func(role string) []string {
		var u []string
		for _, s := range slots {
			if s.role == role {
				u = append(u, s.p.url)
			}
		}
		return u
	}
	for _, s := range slots {
		s.port = freePort(t)
		start(s, 0)
	}
	waitMembers(t, client, router, 60*time.Second, urls("context"), urls("generation"))

	// The load: 16 clients without pause until stopped.
	var ok, failed atomic.Int64
	var mu sync.Mutex
	var errs []string
	ctx, stopLoad := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for c := range 16 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				i := (c + n) % prompts
				rctx, cancel := context.WithTimeout(ctx, reqDeadline)
				ids, o, msg := answer(rctx, client, router, i, n%2 == 0)
				cancel()
				if ctx.Err() != nil {
					return // stopped mid-request: not counted
				}
				if o == okExact && !slices.Equal(ids, cl.want(i)) {
					o, msg = bad, fmt.Sprintf("token ids %v, the aggregated worker's %v", ids, cl.want(i))
				}
				if o == okExact {
					ok.Add(1)
					continue
				}
				failed.Add(1)
				mu.Lock()
				errs = append(errs, fmt.Sprintf("%s: %s", o, msg))
				mu.Unlock()
			}
		})
	}
	defer func() { stopLoad(); wg.Wait() }()
	time.Sleep(time.Second)

	began := time.Now()
	for _, s := range slots {
		before := failed.Load()
		took, exited := s.p.stop(syscall.SIGTERM, 40*time.Second)
		if !exited {
			t.Errorf("%s did not exit within 40 s of SIGTERM", s.p.name)
		}
		restarted := time.Now()
		start(s, 1)
		waitMembers(t, client, router, 60*time.Second, urls("context"), urls("generation"))
		back := time.Since(restarted)
		time.Sleep(500 * time.Millisecond) // some traffic on the new member before the next leave
		t.Logf("rolling restart: %s exited %v after SIGTERM, its successor routable %v after its start; %d failed requests meanwhile",
			s.name, took.Round(time.Millisecond), back.Round(time.Millisecond), failed.Load()-before)
	}
	stopLoad()
	wg.Wait()
	t.Logf("rolling restart of 2+2 workers under 16 concurrent clients (%v): %d requests answered bit-exact, %d failed",
		time.Since(began).Round(time.Millisecond), ok.Load(), failed.Load())
	if failed.Load() != 0 {
		t.Errorf("%d requests failed during the rolling restart, want 0: %v", failed.Load(), errs)
	}
	for _, s := range slots {
		noPinned(t, client, s.p.name, s.p.url)
	}
}
