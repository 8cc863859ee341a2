package serve

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// metricValue returns the value of the gauge or counter name whose labels
// include want, as reg reports it (0 when there is none).
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			n := 0
			for _, l := range m.GetLabel() {
				if v, ok := want[l.GetName()]; ok {
					if v != l.GetValue() {
						continue next
					}
					n++
				}
			}
			if n == len(want) {
				return m.GetGauge().GetValue() + m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// keepAlive connects from address from, gets /health once (HTTP/1.1, so
// the connection stays open afterwards) and returns the idle connection,
// or nil when the server refused it.
func keepAlive(t *testing.T, addr, from string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if errors.Is(err, syscall.ECONNRESET) {
		return nil
	}
	if err != nil {
		t.Error(err)
		return nil
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: worker\r\n\r\n"); err != nil {
		c.Close()
		return nil
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		c.Close()
		return nil
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	c.SetDeadline(time.Time{})
	if resp.StatusCode != http.StatusOK || resp.Close {
		t.Errorf("/health: %s (close %v)", resp.Status, resp.Close)
	}
	return c
}

// TestHTTPKeepAliveFlood is issue #10's HTTP flood: 500 keep-alive
// connections left idle against a worker. The per-host cap refuses the
// excess, the idle timeout closes the rest, a legitimate client is served
// meanwhile, the metrics say so, and the goroutines go back to where they
// were.
func TestHTTPKeepAliveFlood(t *testing.T) {
	const (
		flood   = 500
		perHost = 200
		// Long enough that the whole flood is open before the first of
		// it goes idle, on a busy machine too: with 500 ms, a flood that
		// took longer saw its first connections closed before the cap
		// was reached, and nothing refused.
		idle = 3 * time.Second
	)
	w, err := NewWorker(context.Background(), WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lim := HTTPLimits{MaxConnsPerHost: perHost, IdleTimeout: idle}
	conns := w.Metrics().Conns
	srv := NewHTTPServer(w.Handler(), lim)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(LimitListener(ln, "worker http", lim, nil, conns)) }()
	defer func() {
		srv.Close()
		<-served
	}()
	addr := ln.Addr().String()
	base := runtime.NumGoroutine()

	var (
		mu   sync.Mutex
		held []net.Conn
		wg   sync.WaitGroup
		jobs = make(chan struct{}, flood)
	)
	for range flood {
		jobs <- struct{}{}
	}
	close(jobs)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				if c := keepAlive(t, addr, "127.0.0.2"); c != nil {
					mu.Lock()
					held = append(held, c)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	open := func() float64 {
		return metricValue(t, w.Registry(), "kvxfer_connections_open", map[string]string{"listener": metrics.ListenerHTTP})
	}
	refused := metricValue(t, w.Registry(), "kvxfer_connections_refused_total",
		map[string]string{"listener": metrics.ListenerHTTP, "reason": "max_conns_per_host"})
	if len(held) > perHost || int(refused)+len(held) != flood || refused == 0 {
		t.Errorf("%d keep-alive connections kept and %v refused, want at most %d kept and %d in all", len(held), refused, perHost, flood)
	}

	// A client of another host is served during the flood.
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://" + addr + "/v1/models")
	if err != nil {
		t.Fatalf("a legitimate request during the flood: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a legitimate request during the flood: %s", resp.Status)
	}

	// The idle timeout closes every kept connection.
	for _, c := range held {
		c.SetReadDeadline(time.Now().Add(5 * idle))
		if _, err := c.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatal("an idle keep-alive connection was still open after the idle timeout")
		}
	}
	client.CloseIdleConnections()
	deadline := time.Now().Add(5 * time.Second)
	for open() != 0 || runtime.NumGoroutine() > base+2 {
		if time.Now().After(deadline) {
			t.Fatalf("%v HTTP connections open and %d goroutines (%d before the flood) after the idle timeout", open(), runtime.NumGoroutine(), base)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestHTTPLimitsDefaults(t *testing.T) {
	got := HTTPLimits{MaxConnsPerHost: -1}.WithDefaults()
	want := HTTPLimits{MaxConns: DefaultHTTPMaxConns, MaxConnsPerHost: -1, IdleTimeout: DefaultHTTPIdleTimeout, ReadHeaderTimeout: DefaultHTTPReadHeaderTimeout,
		WriteTimeout: DefaultHTTPWriteTimeout, BodyTimeout: DefaultHTTPBodyTimeout, BodyBudget: DefaultHTTPBodyBudget}
	if got != want {
		t.Errorf("WithDefaults = %+v, want %+v", got, want)
	}
	srv := NewHTTPServer(http.NotFoundHandler(), HTTPLimits{IdleTimeout: -1})
	if srv.IdleTimeout != 0 || srv.ReadHeaderTimeout != DefaultHTTPReadHeaderTimeout || srv.MaxHeaderBytes != MaxHeaderBytes {
		t.Errorf("server limits: idle %v, read header %v, header bytes %d", srv.IdleTimeout, srv.ReadHeaderTimeout, srv.MaxHeaderBytes)
	}
}

// TestStalledReaderReleased: a client that stops reading a stream, its
// connection left open (its receive window closed), used to hold the
// router's handler, its connection to the generation worker and the
// worker's handler for as long as it kept the connection: no write of an
// answer had a deadline. Each write now has HTTPLimits.WriteTimeout: past
// it the router closes the client's connection and the upstream request
// ends.
func TestStalledReaderReleased(t *testing.T) {
	released := make(chan struct{})
	gen := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			return
		}
		defer close(released)
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		ev := []byte(`data: {"choices":[{"text":"` + strings.Repeat("x", 256<<10) + "\"}]}\n\n")
		for range 256 { // 64 MiB at most: far more than the sockets' buffers
			if _, err := w.Write(ev); err != nil {
				return
			}
		}
		t.Error("the generation worker wrote its whole stream: the client read it")
	}))
	defer gen.Close()
	_, cu := startFake(t, "ctx", "length")
	r, err := NewRouter(RouterOptions{Context: []string{cu}, Generation: []string{gen.URL}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const writeTimeout = 300 * time.Millisecond
	srv := NewHTTPServer(r.Handler(), HTTPLimits{WriteTimeout: writeTimeout})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		srv.Close()
		<-served
	}()

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.(*net.TCPConn).SetReadBuffer(4 << 10)
	body := `{"prompt":"x","max_tokens":100,"stream":true}`
	if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatal(err)
	}
	// The client reads nothing from here on.
	start := time.Now()
	select {
	case <-released:
		t.Logf("upstream released %v after the request", time.Since(start).Round(time.Millisecond))
	case <-time.After(20 * time.Second):
		t.Fatal("the generation worker still streams to a router whose client stopped reading 20 s ago")
	}
}

// TestSlowBodyRefused: a client that sends its headers on time and then
// its body a trickle at a time (a slowloris of the body) used to hold a
// handler and its connection for as long as it kept sending: only the
// headers had a deadline. The body has HTTPLimits.BodyTimeout now: past
// it the answer is 408 and the connection closed. A stream that lasts
// longer than the body timeout is not cut by it.
func TestSlowBodyRefused(t *testing.T) {
	w := startTestWorker(t, WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const bodyTimeout = 300 * time.Millisecond
	srv := NewHTTPServer(w.w.Handler(), HTTPLimits{BodyTimeout: bodyTimeout})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		srv.Close()
		<-served
	}()

	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\""); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no answer to a body that stopped coming, %v after the headers: %v", time.Since(start).Round(time.Millisecond), err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(b), "did not come in time") {
		t.Errorf("%s %s", resp.Status, b)
	}

	// A request that outlives the body timeout after its body is not cut
	// by it: the deadline is lifted when the body ends.
	long := NewHTTPServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		select {
		case <-time.After(3 * bodyTimeout):
			io.WriteString(rw, "done")
		case <-r.Context().Done():
			t.Error("the request's context ended after its body was read: the body deadline was left on the connection")
		}
	}), HTTPLimits{BodyTimeout: bodyTimeout})
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served2 := make(chan error, 1)
	go func() { served2 <- long.Serve(ln2) }()
	defer func() {
		long.Close()
		<-served2
	}()
	client := &http.Client{Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	resp, err = client.Post("http://"+ln2.Addr().String(), "text/plain", strings.NewReader("a body"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "done" {
		t.Errorf("a request longer than the body timeout: %s %q", resp.Status, b)
	}
}
