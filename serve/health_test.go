package serve

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/memnet"
)

// The router's /health under hostile callers. The tests run in
// testing/synctest bubbles over an in-memory network (internal/memnet), so
// that the health timeout and the reuse time pass on the bubble's fake
// clock.

// probedWorker answers /health and counts the probes: 200, 503 while
// failing is set, or nothing at all while stalled is set (it waits for the
// router to give up on the request).
type probedWorker struct {
	probes  atomic.Int64
	failing atomic.Bool
	stalled atomic.Bool
}

func (p *probedWorker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/health" {
		http.NotFound(w, r)
		return
	}
	p.probes.Add(1)
	switch {
	case p.stalled.Load():
		<-r.Context().Done()
	case p.failing.Load():
		w.WriteHeader(http.StatusServiceUnavailable)
	default:
		w.WriteHeader(http.StatusOK)
	}
}

// serveMem serves h on nw and returns its base URL; the server closes at
// the end of the test.
func serveMem(t *testing.T, nw *memnet.Network, h http.Handler) string {
	t.Helper()
	l, err := nw.Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	s := &http.Server{Handler: h}
	go s.Serve(l)
	t.Cleanup(func() { s.Close() })
	return "http://" + l.Addr().String()
}

// memRouter is a router over nw of the context and generation workers at
// cu and gu, closed at the end of the test.
func memRouter(t *testing.T, nw *memnet.Network, cu, gu []string, d RouterDeadlines) *Router {
	t.Helper()
	tr := &http.Transport{DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) { return nw.Dial(ctx, addr) }}
	r, err := NewRouter(RouterOptions{Context: cu, Generation: gu, Client: &http.Client{Transport: tr}, RouterDeadlines: d})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

// healthBody is the part of the router's /health answer the tests read.
type healthBody struct {
	Status         string `json:"status"`
	ContextServers []struct {
		URL     string `json:"url"`
		Healthy bool   `json:"healthy"`
		Error   string `json:"error"`
	} `json:"context_servers"`
	GenerationServers []struct {
		URL     string `json:"url"`
		Healthy bool   `json:"healthy"`
		Error   string `json:"error"`
	} `json:"generation_servers"`
}

// askHealth calls the router's /health in process.
func askHealth(t *testing.T, h http.Handler) (int, healthBody) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/health", nil))
	var b healthBody
	if err := json.Unmarshal(rec.Body.Bytes(), &b); err != nil {
		t.Errorf("/health answered %d %q: %v", rec.Code, rec.Body.String(), err)
	}
	return rec.Code, b
}

// TestHostileHealthFanOut: 200 concurrent /health calls cost each worker
// one probe, not 200; a stalled worker holds them for the health timeout
// and no longer; calls within HealthReuse of a round are answered from it;
// and a worker that goes down shows within HealthReuse plus the health
// timeout.
func TestHostileHealthFanOut(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		nw := memnet.New()
		ctxW, genW, stallW := &probedWorker{}, &probedWorker{}, &probedWorker{}
		stallW.stalled.Store(true)
		cu, gu, su := serveMem(t, nw, ctxW), serveMem(t, nw, genW), serveMem(t, nw, stallW)
		const healthTimeout = 2 * time.Second
		r := memRouter(t, nw, []string{cu}, []string{gu, su}, RouterDeadlines{HealthTimeout: healthTimeout})
		h := r.Handler()

		const callers = 200
		start := time.Now()
		var wg sync.WaitGroup
		var ok, stalledSeen atomic.Int64
		for range callers {
			wg.Go(func() {
				code, b := askHealth(t, h)
				if code == http.StatusOK {
					ok.Add(1)
				}
				for _, s := range b.GenerationServers {
					if s.URL == su && !s.Healthy {
						stalledSeen.Add(1)
					}
				}
			})
		}
		wg.Wait()
		took := time.Since(start)
		t.Logf("%d concurrent /health: answered in %v; probes: context %d, generation %d, stalled %d",
			callers, took, ctxW.probes.Load(), genW.probes.Load(), stallW.probes.Load())
		if ok.Load() != callers || stalledSeen.Load() != callers {
			t.Errorf("%d of %d answered 200, %d listed the stalled worker unhealthy", ok.Load(), callers, stalledSeen.Load())
		}
		for name, p := range map[string]*probedWorker{"context": ctxW, "generation": genW, "stalled": stallW} {
			if n := p.probes.Load(); n != 1 {
				t.Errorf("%s worker probed %d times by %d concurrent /health calls, want 1", name, n, callers)
			}
		}
		if took > healthTimeout {
			t.Errorf("a stalled worker held /health for %v, beyond the health timeout %v", took, healthTimeout)
		}

		// Within HealthReuse of that round: its answer, no new probe.
		time.Sleep(HealthReuse / 2)
		askHealth(t, h)
		if n := genW.probes.Load(); n != 1 {
			t.Errorf("a call %v after a round probed again: %d probes", HealthReuse/2, n)
		}

		// The generation worker goes down: /health says so within
		// HealthReuse plus the health timeout, however often it is asked
		// meanwhile, and the probes stay at one round per HealthReuse.
		stallW.stalled.Store(false)
		genW.failing.Store(true)
		down, before := time.Now(), genW.probes.Load()
		for {
			_, b := askHealth(t, h)
			if len(b.GenerationServers) == 2 && !b.GenerationServers[0].Healthy {
				break
			}
			if time.Since(down) > HealthReuse+healthTimeout {
				t.Fatalf("a worker down for %v still shows healthy: %+v", time.Since(down), b)
			}
			time.Sleep(10 * time.Millisecond)
		}
		seen := time.Since(down)
		probes := genW.probes.Load() - before
		t.Logf("a worker that went down showed after %v, %d probes meanwhile", seen, probes)
		if limit := int64(seen/HealthReuse) + 1; probes > limit {
			t.Errorf("%d probes of one worker in %v of /health every 10 ms, want at most %d", probes, seen, limit)
		}
	})
}
