package serve

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// dynRouter is a router whose workers register in a built-in store it
// serves itself.
func dynRouter(t *testing.T, static []string) (*Router, *httptest.Server, *memstore.Store) {
	t.Helper()
	st := memstore.New(memstore.Options{})
	t.Cleanup(func() { st.Close() })
	r, err := NewRouter(RouterOptions{Context: static, Cluster: &ClusterOptions{Store: st, Name: "t", MinContext: 1, MinGeneration: 1,
		Handler: memstore.Handler(st, memstore.HandlerOptions{Token: "tok"}), URI: "http://test"},
		RouterDeadlines: RouterDeadlines{ProbeInterval: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	s := httptest.NewServer(r.Handler())
	t.Cleanup(func() {
		s.Close()
		r.Close()
		http.DefaultClient.CloseIdleConnections()
	})
	return r, s, st
}

func register(t *testing.T, st membership.Store, role membership.Role, url string) *membership.Member {
	t.Helper()
	m, err := membership.NewMember(st, membership.Record{Role: role, URL: url, Model: "tiny", Layout: membership.Layout{TP: 1, PP: 1, DP: 1},
		LayoutFingerprint: "f", Backends: []string{"TCP"}, Incarnation: membership.NewIncarnation()},
		membership.MemberOptions{Cluster: "t", Interval: time.Second, TTL: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Register(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func clusterInfoOf(t *testing.T, url string) ClusterInfo {
	t.Helper()
	_, body := get(t, url+"/cluster_info")
	var ci ClusterInfo
	if err := json.Unmarshal([]byte(body), &ci); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return ci
}

// waitFor polls cond every 5 ms for at most limit and returns how long it
// took, failing the test when it never held.
func waitFor(t *testing.T, limit time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > limit {
			t.Fatalf("%s: not within %v", what, limit)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

func TestRouterDynamicMembership(t *testing.T) {
	_, rs, st := dynRouter(t, nil)
	// Not ready: 503 naming the missing role.
	resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, `"missing_role":"context"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if resp, _ := get(t, rs.URL+"/health"); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/health %d while not ready", resp.StatusCode)
	}
	_, cu := startFake(t, "ctx", "length")
	genW, gu := startFake(t, "gen", "")
	register(t, st, membership.RoleContext, cu)
	// The router hears of a join through its watch: wait for it, then the
	// missing role is the other one.
	waitFor(t, 10*time.Second, "context join", func() bool {
		return len(clusterInfoOf(t, rs.URL).CurrentWorkers["context_servers"]) == 1
	})
	resp, body = post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode == http.StatusServiceUnavailable && !strings.Contains(body, `"missing_role":"generation"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	gm := register(t, st, membership.RoleGeneration, gu)
	took := waitFor(t, 5*time.Second, "join", func() bool { return clusterInfoOf(t, rs.URL).IsReady })
	t.Logf("a join is routable after %v", took)
	resp, body = post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode != 200 || genW.calls.Load() != 1 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	ci := clusterInfoOf(t, rs.URL)
	if g := ci.CurrentWorkers["generation_servers"]; len(g) != 1 || g[0].Model != "tiny" || g[0].Static || g[0].Backends[0] != "TCP" {
		t.Errorf("cluster_info %+v", ci)
	}
	if _, body := get(t, rs.URL+"/metrics"); !strings.Contains(body, `kvxfer_router_workers{role="generation",state="up"} 1`) {
		t.Errorf("metrics: no kvxfer_router_workers up 1")
	}
	// A leave removes it.
	if err := gm.Deregister(t.Context()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "leave", func() bool { return !clusterInfoOf(t, rs.URL).IsReady })
	resp, body = post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, `"missing_role":"generation"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

// A registered worker that dies is marked down by the first request that
// cannot reach it, long before its lease ends, and is re-admitted when it
// answers again.
func TestRouterDynamicMarkDown(t *testing.T) {
	_, rs, st := dynRouter(t, nil)
	_, cu := startFake(t, "ctx", "length")
	genW, gu := startFake(t, "gen", "")
	dead := deadURL(t)
	register(t, st, membership.RoleContext, cu)
	register(t, st, membership.RoleGeneration, gu)
	register(t, st, membership.RoleGeneration, dead)
	waitFor(t, 5*time.Second, "joins", func() bool { return len(clusterInfoOf(t, rs.URL).CurrentWorkers["generation_servers"]) == 2 })
	for range 4 {
		if resp, body := post(t, rs.URL+"/v1/completions", `{"prompt":"hi"}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	if genW.calls.Load() != 4 {
		t.Errorf("gen calls %d", genW.calls.Load())
	}
	down := 0
	for _, w := range clusterInfoOf(t, rs.URL).CurrentWorkers["generation_servers"] {
		if w.MarkedDown {
			down++
			if w.URL != dead {
				t.Errorf("%s marked down", w.URL)
			}
		}
	}
	if down != 1 {
		t.Errorf("%d marked down, want the dead one", down)
	}
	if _, body := get(t, rs.URL+"/metrics"); !strings.Contains(body, `kvxfer_router_workers{role="generation",state="down"} 1`) {
		t.Errorf("metrics: no kvxfer_router_workers down 1")
	}
}

// The built-in store is served on the router's listener, behind its token.
func TestRouterServesBuiltInStore(t *testing.T) {
	_, rs, _ := dynRouter(t, nil)
	c, err := memstore.NewClient(rs.URL, memstore.ClientOptions{Token: "wrong"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.List(t.Context(), membership.Prefix("t")); err == nil {
		t.Fatal("a wrong token was accepted")
	}
	c2, err := memstore.NewClient(rs.URL, memstore.ClientOptions{Token: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	_, gu := startFake(t, "gen", "")
	register(t, c2, membership.RoleGeneration, gu)
	waitFor(t, 5*time.Second, "join over http", func() bool { return len(clusterInfoOf(t, rs.URL).CurrentWorkers["generation_servers"]) == 1 })
}
