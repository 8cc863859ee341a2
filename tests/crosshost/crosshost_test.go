package crosshost

import (
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/internal/procnet"
)

const (
	routerPort = 8000
	etcdPort   = 2379
	ctxPort    = 8001
	genPort    = 8002
	// reqDeadline bounds every request of the tests: a request that is
	// neither answered nor refused within it is a hang.
	reqDeadline = 30 * time.Second
)

// cluster is the cross-host cluster: etcd (or the router's built-in store)
// and the router in namespace "r", a context worker (TP2) in "c", a
// generation worker (TP1) in "g", the aggregated worker the answers are
// compared with in the test's own namespace.
type cluster struct {
	t       *testing.T
	lab     *lab
	r, c, g *host
	ps      *procs
	dir     string
	dc      string // the disagg_cluster block
	// peerHosts, when set, is the workers' security.allowed_peer_hosts
	// (a proxy between them: see faults).
	peerHosts []string
	router    string // the router's URL
	client    *http.Client
	aggURL    string
	wantMu    sync.Mutex
	wantIDs   map[int][]int32
}

func newCluster(t *testing.T) *cluster {
	l := newLab(t)
	cl := &cluster{t: t, lab: l, dir: t.TempDir(), wantIDs: map[int][]int32{},
		client: &http.Client{Timeout: reqDeadline + 5*time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}}
	cl.r, cl.c, cl.g = l.addHost("r", 2), l.addHost("c", 3), l.addHost("g", 4)
	secret := make([]byte, 32)
	rand.Read(secret)
	// UCX_TLS=tcp: the namespaces share one kernel (and IPC namespace),
	// so UCX left alone would move the bytes through shared memory or cma
	// instead of the veth pairs.
	cl.ps = newProcs(t, "KVXFER_CLUSTER_SECRET="+hex.EncodeToString(secret), "UCX_TLS=tcp")
	t.Cleanup(cl.client.CloseIdleConnections)
	cl.router = fmt.Sprintf("http://%s:%d", cl.r.addr, routerPort)
	uri := cl.router // the router's built-in store, unless etcd is here
	if bin, err := exec.LookPath("etcd"); err == nil {
		uri = "etcd://" + cl.startEtcd(bin)
	} else if v := os.Getenv("KVXFER_REQUIRE_ETCD"); v != "" && v != "0" {
		t.Fatal("no etcd binary on PATH and KVXFER_REQUIRE_ETCD is set")
	} else {
		t.Logf("no etcd binary on PATH: the router's built-in store (%s) instead", uri)
	}
	cl.dc = fmt.Sprintf("disagg_cluster:\n  cluster_uri: %q\n  cluster_name: xh\n  minimal_instances: {context_servers: 1, generation_servers: 1}\n"+
		"  heartbeat_interval_sec: 1\n  inactive_timeout_sec: 5\n", uri)
	cy := filepath.Join(cl.dir, "cluster.yaml")
	os.WriteFile(cy, fmt.Appendf(nil, "hostname: %s\nport: %d\n%s", cl.r.addr, routerPort, cl.dc), 0o600)
	cl.ps.start("router", cl.r.name, "", "router", "--config", cy, "--admin-addr", "", "--probe-interval", "100ms")
	af := filepath.Join(cl.dir, "aggregated.yaml")
	os.WriteFile(af, []byte("kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}\n"), 0o600)
	port := freePort(t)
	agg := cl.ps.start("aggregated", "", "", "serve", "--role", "both", "--host", "127.0.0.1", "--port", fmt.Sprint(port), "--admin-addr", "",
		"--config", af)
	agg.url = fmt.Sprintf("http://127.0.0.1:%d", port)
	cl.waitHealthy(agg)
	cl.aggURL = agg.url
	return cl
}

// startEtcd runs etcd in the router's namespace, on its address.
func (cl *cluster) startEtcd(bin string) string {
	t := cl.t
	addr := fmt.Sprintf("%s:%d", cl.r.addr, etcdPort)
	client, peer := "http://"+addr, "http://127.0.0.1:2380"
	cl.ps.start("etcd", cl.r.name, bin, "--name", "xh", "--data-dir", filepath.Join(cl.dir, "etcd"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "xh="+peer,
		"--initial-cluster-state", "new", "--log-level", "warn")
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := cl.client.Get(client + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return addr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd at %s not healthy after 20 s: %v", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// workerFile writes a worker file for the transceiver backend.
func (cl *cluster) workerFile(backend string) string {
	p := filepath.Join(cl.dir, "worker-"+strings.ToLower(backend)+".yaml")
	sec := ""
	if len(cl.peerHosts) > 0 {
		sec = "security: {allowed_peer_hosts: [" + strings.Join(cl.peerHosts, ", ") + "]}\n"
	}
	os.WriteFile(p, fmt.Appendf(nil, "kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}\n"+
		"cache_transceiver_config: {backend: %s, kv_transfer_timeout_ms: 5000}\n%s%s", backend, sec, cl.dc), 0o600)
	return p
}

// waitHealthy waits until p answers /health with 200.
func (cl *cluster) waitHealthy(p *proc) {
	t := cl.t
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := cl.client.Get(p.url + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited: %s", p.name, lastLines(p.logs.String(), 20))
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("%s not healthy after 60 s: %s", p.name, lastLines(p.logs.String(), 20))
}

// freePort returns a loopback port below the ephemeral range that was
// free a moment ago (package freeport says why).
func freePort(t *testing.T) int {
	t.Helper()
	p, err := freeport.Port()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// kvxferVersion runs `kvxfer version` (this binary as the CLI).
func kvxferVersion() ([]byte, error) {
	cmd := exec.Command(os.Args[0], "version")
	cmd.Env = append(os.Environ(), envChild+"=1")
	return cmd.CombinedOutput()
}

// want is the aggregated worker's answer to prompt i.
func (cl *cluster) want(i int) []int32 {
	cl.wantMu.Lock()
	defer cl.wantMu.Unlock()
	if ids, ok := cl.wantIDs[i]; ok {
		return ids
	}
	ids, o, msg := answer(cl.t.Context(), cl.client, cl.aggURL, i, false)
	if o != okExact || len(ids) != maxTokens {
		cl.t.Errorf("the aggregated worker on prompt %d: %s (%d ids)", i, msg, len(ids))
	}
	cl.wantIDs[i] = ids
	return ids
}

// workers is one context and one generation worker.
type workers struct{ ctx, gen *proc }

// startWorkers starts the context worker (TP2) in c and the generation
// worker (TP1) in g, each listening and registering on its namespace's
// address; their transceivers listen on ctxTx and genTx.
func (cl *cluster) startWorkers(backend, ctxTx, genTx string) workers {
	cl.t.Helper()
	wf := cl.workerFile(backend)
	start := func(name, role string, h *host, port int, tx string, tp string) *proc {
		p := cl.ps.start(name, h.name, "", "serve", "--role", role, "--tp", tp, "--config", wf,
			"--host", h.addr, "--port", fmt.Sprint(port), "--advertise-host", h.addr, "--transceiver-host", tx, "--admin-addr", "")
		p.url = fmt.Sprintf("http://%s:%d", h.addr, port)
		return p
	}
	w := workers{start("context-"+backend, "context", cl.c, ctxPort, ctxTx, "2"), start("generation-"+backend, "generation", cl.g, genPort, genTx, "1")}
	took := waitMembers(cl.t, cl.client, cl.router, 60*time.Second, []string{w.ctx.url}, []string{w.gen.url})
	cl.t.Logf("%s: context (TP2, %s) and generation (TP1, %s) registered and routable after %v", backend, w.ctx.url, w.gen.url, took.Round(time.Millisecond))
	return w
}

// stopWorkers SIGTERMs both (a graceful leave) and waits until the router
// routes to neither.
func (cl *cluster) stopWorkers(w workers) {
	cl.t.Helper()
	for _, p := range []*proc{w.ctx, w.gen} {
		if took, ok := p.stop(syscall.SIGTERM, 40*time.Second); !ok {
			cl.t.Errorf("%s did not exit within %v of SIGTERM", p.name, took)
		}
	}
	waitMembers(cl.t, cl.client, cl.router, 10*time.Second, nil, nil)
}

// txListeners returns the TCP listeners of p on addr, failing if any of
// its listeners is elsewhere than want (its HTTP and transceiver hosts).
func txListeners(t *testing.T, p *proc, addr string, want ...string) []netip.AddrPort {
	t.Helper()
	ls, err := procnet.Listening(p.cmd.Process.Pid)
	if err != nil {
		t.Fatalf("%s: listeners: %v", p.name, err)
	}
	var on []netip.AddrPort
	for _, l := range ls {
		a := l.Addr.Addr().String()
		if a == addr {
			on = append(on, l.Addr)
		}
		ok := false
		for _, w := range want {
			ok = ok || a == w
		}
		if !ok {
			t.Errorf("%s listens on %v: neither its HTTP nor its transceiver host (%v)", p.name, l.Addr, want)
		}
	}
	return on
}

// onlyBackends, when set, makes TestCrossHost run the disaggregated flow
// over these backends only (comma-separated: TCP, UCX, AUTO), without the
// 2+2 workers and the fault proxy, which run over TCP whatever the build.
// make ucx sets UCX,AUTO: what a -tags ucx build adds to the unit step's
// run (UCX, and what AUTO picks when UCX is built in).
var onlyBackends = flag.String("crosshost.backends", "", "run TestCrossHost's flow over these backends only (TCP,UCX,AUTO), without its TCP-only 2+2 and fault phases")

// TestCrossHost runs the disaggregated flow between network namespaces
// over each transceiver backend, then with 2 + 2 workers, then through a
// fault proxy between the context and generation workers' namespaces.
func TestCrossHost(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level: network namespaces, etcd, a router and workers")
	}
	start := time.Now()
	cl := newCluster(t)
	t.Logf("lab: bridge %s %s0/24; router and store in %s (%s), context in %s (%s), generation in %s (%s); ready after %v",
		cl.lab.bridge, cl.lab.prefix, cl.r.name, cl.r.addr, cl.c.name, cl.c.addr, cl.g.name, cl.g.addr, time.Since(start).Round(time.Millisecond))

	out, err := kvxferVersion()
	built := versionBackends(out)
	backends := []string{"TCP", "AUTO"}
	if err == nil && strings.Contains(built, "ucx") {
		backends = []string{"TCP", "UCX", "AUTO"}
	} else {
		t.Logf("UCX: not in this build (backends %q): run with -tags ucx to cover it", built)
	}
	if *onlyBackends != "" {
		backends = strings.Split(*onlyBackends, ",")
		for _, b := range backends {
			if b != "TCP" && b != "UCX" && b != "AUTO" {
				t.Fatalf("-crosshost.backends=%s: %q is none of TCP, UCX, AUTO", *onlyBackends, b)
			}
		}
		if slices.Contains(backends, "UCX") && (err != nil || !strings.Contains(built, "ucx")) {
			t.Fatalf("-crosshost.backends=%s names UCX, not in this build (backends %q, %v)", *onlyBackends, built, err)
		}
	}
	next := 0
	for _, b := range backends {
		w := cl.startWorkers(b, cl.c.addr, cl.g.addr)
		for _, p := range []struct {
			p    *proc
			addr string
		}{{w.ctx, cl.c.addr}, {w.gen, cl.g.addr}} {
			n := txListeners(t, p.p, p.addr, p.addr)
			t.Logf("%s: %d TCP listeners, all on %s", p.p.name, len(n), p.addr)
		}
		tl := burst(t, cl.client, cl.router, next, 8, 4, reqDeadline, cl.want)
		next += 8
		moved := map[string]float64{} // by backend label, both workers
		for _, url := range []string{w.gen.url, w.ctx.url} {
			for be, v := range bytesByBackend(cl.client, url) {
				moved[be] += v
			}
		}
		total := func(prefix string) (n float64) {
			for be, v := range moved {
				if strings.HasPrefix(be, prefix) {
					n += v
				}
			}
			return n
		}
		t.Logf("backend %s: %s; kvxfer_transfer_bytes_total by backend (both workers): %v", b, tl, moved)
		if tl.n[okExact] != 8 {
			t.Errorf("backend %s: want 8 bit-exact: %v", b, tl.errs)
		}
		for be := range moved {
			// shm, and UCX over its shared-memory transports, would mean
			// the bytes did not cross the namespaces' network.
			if be != "tcp" && be != "ucx(tcp)" {
				t.Errorf("backend %s: %v bytes over %s between network namespaces", b, moved[be], be)
			}
		}
		switch wantBE := strings.ToLower(b); wantBE {
		case "tcp", "ucx":
			if total(wantBE) == 0 {
				t.Errorf("backend %s: no bytes over %s: %s", b, wantBE, metricLines(cl.client, w.gen.url, "kvxfer_transfer_bytes_total"))
			}
		default: // AUTO
			if total("tcp")+total("ucx") == 0 {
				t.Errorf("AUTO: no bytes over tcp or ucx: %s", metricLines(cl.client, w.gen.url, "kvxfer_transfer_bytes_total"))
			}
			fallbacks, line := 0, ""
			for l := range strings.SplitSeq(w.gen.logs.String(), "\n") {
				if strings.Contains(l, "shm not usable with this peer") {
					fallbacks, line = fallbacks+1, l
				}
			}
			t.Logf("AUTO: the generation worker logged %d shm fallbacks, e.g. %s", fallbacks, strings.TrimSpace(line))
			if fallbacks == 0 {
				t.Errorf("AUTO: no shm probe failed: did it probe at all?")
			}
		}
		noPinned(t, cl.client, w.ctx.name, w.ctx.url)
		noPinned(t, cl.client, w.gen.name, w.gen.url)
		cl.stopWorkers(w)
	}
	t.Logf("backends done after %v", time.Since(start).Round(time.Millisecond))
	if t.Failed() {
		return
	}
	if *onlyBackends != "" {
		t.Logf("-crosshost.backends=%s: the 2+2 workers and the fault proxy (both TCP) not run", *onlyBackends)
		return
	}
	next = cl.twoByTwo(next)
	cl.faults(next)
	t.Logf("TestCrossHost took %v", time.Since(start).Round(time.Millisecond))
}

// twoByTwo runs 2 context (TP2) + 2 generation (TP1) workers, each in a
// namespace of its own (c, c2, g, g2), over TCP: 16 requests, 8 at a
// time, each worker must serve some and every answer be bit-exact.
func (cl *cluster) twoByTwo(next int) int {
	t := cl.t
	c2, g2 := cl.lab.addHost("c2", 5), cl.lab.addHost("g2", 6)
	wf := cl.workerFile("TCP")
	var all []*proc
	start := func(name, role string, h *host, port int, tp string) *proc {
		p := cl.ps.start(name, h.name, "", "serve", "--role", role, "--tp", tp, "--config", wf,
			"--host", h.addr, "--port", fmt.Sprint(port), "--advertise-host", h.addr, "--transceiver-host", h.addr, "--admin-addr", "")
		p.url = fmt.Sprintf("http://%s:%d", h.addr, port)
		all = append(all, p)
		return p
	}
	ctx := []*proc{start("context-a", "context", cl.c, ctxPort, "2"), start("context-b", "context", c2, ctxPort, "2")}
	gen := []*proc{start("generation-a", "generation", cl.g, genPort, "1"), start("generation-b", "generation", g2, genPort, "1")}
	took := waitMembers(t, cl.client, cl.router, 60*time.Second, []string{ctx[0].url, ctx[1].url}, []string{gen[0].url, gen[1].url})
	tl := burst(t, cl.client, cl.router, next, 16, 8, reqDeadline, cl.want)
	served := map[string]float64{}
	for _, p := range all {
		served[p.name], _ = metric(cl.client, p.url, "kvxfer_http_requests_total", `/v1/completions`)
	}
	t.Logf("2+2 across hosts (TCP, 4 worker namespaces, routable %v after start): %s; requests served per worker %v", took.Round(time.Millisecond), tl, served)
	if tl.n[okExact] != 16 {
		t.Errorf("2+2: want 16 bit-exact: %v", tl.errs)
	}
	for _, p := range all {
		if served[p.name] == 0 {
			t.Errorf("2+2: %s served no request", p.name)
		}
		noPinned(t, cl.client, p.name, p.url)
	}
	for _, p := range all {
		if took, ok := p.stop(syscall.SIGTERM, 40*time.Second); !ok {
			t.Errorf("%s did not exit within %v of SIGTERM", p.name, took)
		}
	}
	waitMembers(t, cl.client, cl.router, 10*time.Second, nil, nil)
	return next + 16
}

// versionBackends is the "backends:" line of `kvxfer version`.
func versionBackends(out []byte) string {
	for l := range strings.SplitSeq(string(out), "\n") {
		if v, ok := strings.CutPrefix(l, "backends:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}
