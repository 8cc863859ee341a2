package memstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/membershiptest"
)

// serve runs s behind Handler on a loopback server for the test.
func serve(t *testing.T, s *Store, opts HandlerOptions) string {
	addr, _ := serveCounting(t, s, opts)
	return addr
}

// serveCounting is serve that also counts the server's open connections.
func serveCounting(t *testing.T, s *Store, opts HandlerOptions) (string, *atomic.Int64) {
	var conns atomic.Int64
	mux := http.NewServeMux()
	mux.Handle(BasePath+"/", Handler(s, opts))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			conns.Add(1)
		case http.StateClosed, http.StateHijacked:
			conns.Add(-1)
		}
	}
	srv.Start()
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	return srv.Listener.Addr().String(), &conns
}

// released waits up to 2 s for the clients of a server of serveCounting
// to have closed every connection and ended every long poll on s.
func released(t *testing.T, s *Store, conns *atomic.Int64, what string) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); (conns.Load() > 0 || s.polling() > 0) && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if n, p := conns.Load(), s.polling(); n != 0 || p != 0 {
		t.Errorf("%s: %d connections open, %d polls under way; want none", what, n, p)
	}
}

// TestConformance runs the suite on the built-in store over HTTP (Client →
// Handler → Store), with a short poll so that long polls are exercised.
func TestConformance(t *testing.T) {
	s := New(Options{MinTTL: 500 * time.Millisecond, History: 64})
	t.Cleanup(func() { s.Close() })
	// The suite puts keys without a lease, which the store allows and
	// the handler refuses by default.
	addr, conns := serveCounting(t, s, HandlerOptions{AllowUnleased: true})
	membershiptest.Run(t, membershiptest.Harness{
		Addr: addr,
		Dial: func(t testing.TB, addr string) membership.Store {
			c, err := NewClient("http://"+addr, ClientOptions{PollWait: 300 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			return c
		},
		Compact: func(t testing.TB, rev int64) { s.Compact(rev) },
		MinTTL:  500 * time.Millisecond,
	})
	// Every test closed its clients: their connections, kept alive
	// between calls, are closed, and no long poll holds a slot.
	released(t, s, conns, "after the suite")
}

// TestHistoryBound: a watcher that falls further behind than the history
// gets ErrCompacted, as after etcd's compaction.
func TestHistoryBound(t *testing.T) {
	s := New(Options{History: 4})
	defer s.Close()
	ctx := t.Context()
	w, err := s.Watch(ctx, "/p/", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for range 6 {
		if _, err := s.Put(ctx, "/p/k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Next(ctx); !errors.Is(err, membership.ErrCompacted) {
		t.Fatalf("Next after 6 puts with a history of 4: %v, want ErrCompacted", err)
	}
}

func TestLimits(t *testing.T) {
	s := New(Options{MaxKeys: 2, MaxLeases: 1, MaxWatchers: 1, MaxValue: 8, MaxTTL: time.Minute})
	defer s.Close()
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		err  error
		want error
		msg  string
	}{
		{"value", second(s.Put(ctx, "/a", make([]byte, 9), 0)), membership.ErrLimit, "at most 8"},
		{"key", second(s.Put(ctx, "", nil, 0)), membership.ErrInvalid, "key"},
		{"long key", second(s.Put(ctx, "/"+strings.Repeat("k", membership.MaxKeySize), nil, 0)), membership.ErrInvalid, "key"},
		{"ttl", third(s.Grant(ctx, time.Hour)), membership.ErrInvalid, "ttl"},
	} {
		if !errors.Is(tc.err, tc.want) || !strings.Contains(tc.err.Error(), tc.msg) {
			t.Errorf("%s: %v, want %v containing %q", tc.name, tc.err, tc.want, tc.msg)
		}
	}
	for _, k := range []string{"/a", "/b"} {
		if _, err := s.Put(ctx, k, nil, 0); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Put(ctx, "/c", nil, 0); !errors.Is(err, membership.ErrLimit) || !strings.Contains(err.Error(), "2 keys") {
		t.Errorf("third key: %v, want ErrLimit naming 2 keys", err)
	}
	if _, err := s.Put(ctx, "/a", []byte("x"), 0); err != nil {
		t.Errorf("overwriting a key at the cap: %v", err)
	}
	if _, _, err := s.Grant(ctx, time.Second); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Grant(ctx, time.Second); !errors.Is(err, membership.ErrLimit) || !strings.Contains(err.Error(), "1 leases") {
		t.Errorf("second lease: %v, want ErrLimit", err)
	}
	w, err := s.Watch(ctx, "/", 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Watch(ctx, "/", 0); !errors.Is(err, membership.ErrLimit) || !strings.Contains(err.Error(), "1 watchers") {
		t.Errorf("second watcher: %v, want ErrLimit", err)
	}
	w.Close()
	w.Close()
	w, err = s.Watch(ctx, "/", 0)
	if err != nil {
		t.Errorf("a watcher after one closed: %v", err)
	} else {
		w.Close()
	}
}

func second[A any](_ A, err error) error        { return err }
func third[A, B any](_ A, _ B, err error) error { return err }

// TestHTTPErrors: the handler's answers to hostile or wrong requests.
func TestHTTPErrors(t *testing.T) {
	s := New(Options{MaxWatchers: 1})
	defer s.Close()
	addr := serve(t, s, HandlerOptions{Token: "sekrit"})
	post := func(path, token, body string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+path, strings.NewReader(body))
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Body.Close()
		var b [512]byte
		n, _ := r.Body.Read(b[:])
		return r.StatusCode, string(b[:n])
	}
	for _, tc := range []struct {
		path, token, body string
		status            int
		msg               string
	}{
		{BasePath + "/list", "", `{"prefix":"/"}`, 401, "bearer token"},
		{BasePath + "/list", "wrong", `{"prefix":"/"}`, 401, "bearer token"},
		{BasePath + "/list", "sekrit", `{"prefix":"/"}`, 200, `"rev":0`},
		{BasePath + "/nope", "sekrit", `{}`, 400, "no call"},
		{BasePath + "/list", "sekrit", `{"prefix":"/","extra":1}`, 400, "unknown field"},
		{BasePath + "/list", "sekrit", `{"prefix":"/"} {}`, 400, "trailing"},
		{BasePath + "/list", "sekrit", `[1,2]`, 400, "invalid"},
		{BasePath + "/grant", "sekrit", `{"ttl_ms":-5}`, 400, "ttl_ms"},
		{BasePath + "/keepalive", "sekrit", `{"lease":77}`, 404, "lease_not_found"},
		{BasePath + "/put", "sekrit", `{"key":"","value":"eA=="}`, 400, "key"},
		{BasePath + "/put", "sekrit", `{"key":"/k","value":"!!"}`, 400, "invalid"},
		{BasePath + "/watch", "sekrit", `{"prefix":"/","from":-1}`, 400, "from"},
		{BasePath + "/list", "sekrit", `{"prefix":"` + strings.Repeat("a", maxRequestBody) + `"}`, 429, "body over"},
	} {
		status, body := post(tc.path, tc.token, tc.body)
		if status != tc.status || !strings.Contains(body, tc.msg) {
			t.Errorf("POST %s %.60q: %d %s, want %d containing %q", tc.path, tc.body, status, body, tc.status, tc.msg)
		}
	}
	r, err := http.Get("http://" + addr + BasePath + "/list")
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("GET: %d, want 405", r.StatusCode)
	}
	// The client sees the sentinels.
	c, err := NewClient("http://"+addr, ClientOptions{Token: "sekrit"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.KeepAlive(t.Context(), 99); !errors.Is(err, membership.ErrLeaseNotFound) {
		t.Errorf("client KeepAlive of no lease: %v, want ErrLeaseNotFound", err)
	}
	bad, _ := NewClient("http://"+addr, ClientOptions{Token: "nope"})
	defer bad.Close()
	if _, _, err := bad.List(t.Context(), "/"); err == nil || !strings.Contains(err.Error(), "401") {
		t.Errorf("client with a wrong token: %v, want status 401", err)
	}
	if _, err := NewClient("etcd://x:1", ClientOptions{}); !errors.Is(err, membership.ErrInvalid) {
		t.Errorf("NewClient(etcd://): %v", err)
	}
}

// TestWatchCloseEndsNext: closing a watcher ends a Next waiting on the
// server.
func TestWatchCloseEndsNext(t *testing.T) {
	s := New(Options{})
	defer s.Close()
	c, _ := NewClient("http://"+serve(t, s, HandlerOptions{}), ClientOptions{PollWait: 5 * time.Second})
	defer c.Close()
	for _, st := range []membership.Store{s, c} {
		w, err := st.Watch(t.Context(), "/", 0)
		if err != nil {
			t.Fatal(err)
		}
		errc := make(chan error, 1)
		go func() { _, err := w.Next(context.Background()); errc <- err }()
		time.Sleep(50 * time.Millisecond)
		w.Close()
		select {
		case err := <-errc:
			if !errors.Is(err, membership.ErrClosed) {
				t.Errorf("%T: Next after Close: %v, want ErrClosed", st, err)
			}
		case <-time.After(3 * time.Second):
			t.Fatalf("%T: Next still running 3 s after Close", st)
		}
	}
}

// TestClientCloseEndsPolls: closing a Client ends what it has under way,
// as closing either other store does: a watcher's Next waiting in a long
// poll returns ErrClosed at once, not when the poll ends (up to PollWait,
// 10 s by default), the client's connections close and the poll's slot on
// the server comes back.
func TestClientCloseEndsPolls(t *testing.T) {
	s := New(Options{})
	defer s.Close()
	addr, conns := serveCounting(t, s, HandlerOptions{})
	c, err := NewClient("http://"+addr, ClientOptions{PollWait: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.Watch(t.Context(), "/", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	errc := make(chan error, 1)
	go func() { _, err := w.Next(context.Background()); errc <- err }()
	for deadline := time.Now().Add(2 * time.Second); s.polling() == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if s.polling() != 1 {
		t.Fatalf("%d polls under way, want the watcher's", s.polling())
	}
	c.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, membership.ErrClosed) {
			t.Errorf("Next after the client's Close: %v, want ErrClosed", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("Next still waiting in its poll 3 s after the client's Close")
	}
	released(t, s, conns, "after the client's Close")
	if _, _, err := c.List(t.Context(), "/"); !errors.Is(err, membership.ErrClosed) {
		t.Errorf("List after Close: %v, want ErrClosed", err)
	}
}

// TestRouterRestart: the built-in store lives in the router; when the
// router restarts on the same address with an empty store, every worker
// finds its lease gone and registers again, and a new View sees them all
// within about one heartbeat.
func TestRouterRestart(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	start := func(ln net.Listener) (*Store, *httptest.Server) {
		s := New(Options{MinTTL: 100 * time.Millisecond})
		mux := http.NewServeMux()
		mux.Handle(BasePath+"/", Handler(s, HandlerOptions{}))
		srv := httptest.NewUnstartedServer(mux)
		srv.Listener.Close()
		srv.Listener = ln
		srv.Start()
		return s, srv
	}
	s1, srv1 := start(ln)
	c, _ := NewClient("http://"+addr, ClientOptions{PollWait: 200 * time.Millisecond})
	defer c.Close()
	interval, ttl := 200*time.Millisecond, time.Second
	var members []*membership.Member
	for i := range 3 {
		rec := membership.Record{Role: membership.RoleContext, URL: fmt.Sprintf("http://127.0.0.1:%d", 25000+i), Layout: membership.Layout{TP: 1, PP: 1, DP: 1}, Incarnation: 5}
		m, err := membership.NewMember(c, rec, membership.MemberOptions{Cluster: "r", Interval: interval, TTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Register(t.Context()); err != nil {
			t.Fatal(err)
		}
		members = append(members, m)
	}
	srv1.CloseClientConnections()
	srv1.Close()
	s1.Close()
	time.Sleep(300 * time.Millisecond) // the router is away for more than an interval

	var ln2 net.Listener
	for range 50 { // the old listener's port is free again
		if ln2, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	s2, srv2 := start(ln2)
	defer func() { srv2.CloseClientConnections(); srv2.Close(); s2.Close() }()
	restarted := time.Now()
	v := membership.NewView(s2, membership.ViewOptions{Cluster: "r"})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); v.Run(ctx) }() //nolint:errcheck // ends with ctx
	defer func() { cancel(); <-done }()
	for len(v.Workers("")) < 3 {
		if time.Since(restarted) > 5*time.Second {
			t.Fatalf("after 5 s the restarted router has %d of 3 workers", len(v.Workers("")))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("all 3 workers back %v after the restart (heartbeat %v)", time.Since(restarted).Round(time.Millisecond), interval)
	// The store has the records; a member counts its re-registration once
	// its Put has answered, a moment after the View may have seen it.
	for _, m := range members {
		deadline := time.Now().Add(2 * time.Second)
		st := m.Status()
		for st.Reregistrations == 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
			st = m.Status()
		}
		if st.Reregistrations != 1 || !st.Registered {
			t.Errorf("%s: status %+v, want registered again, once", m.Key(), st)
		}
	}
}

// TestHTTPProxiedWithoutToken: a store without a token (kvxfer router
// allows that on loopback only) refuses a call that a proxy forwarded
// (Forwarded, X-Forwarded-For, X-Real-IP, Via): the loopback peer is then
// the proxy, and the caller anyone the proxy serves, who could revoke the
// workers' leases (List shows them) or fill the store. With a token, a
// call through a proxy is as good as any other.
func TestHTTPProxiedWithoutToken(t *testing.T) {
	s := New(Options{})
	defer s.Close()
	open := serve(t, s, HandlerOptions{})
	withToken := serve(t, s, HandlerOptions{Token: "sekrit"})
	post := func(addr, token string, hdr [2]string) int {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+BasePath+"/list", strings.NewReader(`{"prefix":"/"}`))
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		if hdr[0] != "" {
			req.Header.Set(hdr[0], hdr[1])
		}
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		return r.StatusCode
	}
	if st := post(open, "", [2]string{}); st != http.StatusOK {
		t.Errorf("direct call without token: %d, want 200", st)
	}
	for _, h := range [][2]string{{"X-Forwarded-For", "203.0.113.9"}, {"Forwarded", "for=203.0.113.9"}, {"X-Real-Ip", "203.0.113.9"}, {"Via", "1.1 proxy"}} {
		if st := post(open, "", h); st != http.StatusForbidden {
			t.Errorf("%s without token: %d, want 403", h[0], st)
		}
		if st := post(withToken, "sekrit", h); st != http.StatusOK {
			t.Errorf("%s with the token: %d, want 200", h[0], st)
		}
	}
}

// TestHTTPPollsSpareTheRouter: the HTTP long polls have a cap of their
// own (MaxPolls): whoever holds as many polls as it may (each waits up to
// MaxWait, and a client polls again at once) does not take the watcher
// slots of the router's own view, which it needs after a compaction to
// watch again.
func TestHTTPPollsSpareTheRouter(t *testing.T) {
	s := New(Options{MaxWatchers: 1, MaxPolls: 2})
	defer s.Close()
	addr := serve(t, s, HandlerOptions{})
	poll := func() (int, error) {
		// From a revision far ahead: the poll waits its whole wait_ms.
		r, err := http.Post("http://"+addr+BasePath+"/watch", "application/json", strings.NewReader(`{"prefix":"/","from":1000000,"wait_ms":3000}`))
		if err != nil {
			return 0, err
		}
		r.Body.Close()
		return r.StatusCode, nil
	}
	type res struct {
		status int
		err    error
	}
	held := make(chan res, 2)
	for range 2 {
		go func() { st, err := poll(); held <- res{st, err} }()
	}
	deadline := time.Now().Add(2 * time.Second)
	for s.polling() < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if st, err := poll(); err != nil || st != http.StatusTooManyRequests {
		t.Errorf("a third poll: %d, %v, want 429", st, err)
	}
	w, err := s.Watch(t.Context(), "/", 0)
	if err != nil {
		t.Errorf("the router's watch while the polls are held: %v", err)
	} else {
		w.Close()
	}
	for range 2 {
		if r := <-held; r.err != nil || r.status != http.StatusOK {
			t.Errorf("held poll: %d, %v", r.status, r.err)
		}
	}
}

// TestHTTPPutNeedsLease: over HTTP a key is put under a lease or not at
// all: a record without one would outlive whoever put it, and the router
// would count it in minimal_instances, and route to it, for as long as it
// runs. AllowUnleased (the conformance suite) lifts that.
func TestHTTPPutNeedsLease(t *testing.T) {
	s := New(Options{})
	defer s.Close()
	for _, tc := range []struct {
		opts   HandlerOptions
		status int
	}{{HandlerOptions{}, http.StatusBadRequest}, {HandlerOptions{AllowUnleased: true}, http.StatusOK}} {
		addr := serve(t, s, tc.opts)
		post := func(name, body string) (int, string) {
			r, err := http.Post("http://"+addr+BasePath+"/"+name, "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			defer r.Body.Close()
			var b [512]byte
			n, _ := r.Body.Read(b[:])
			return r.StatusCode, string(b[:n])
		}
		if st, body := post("put", `{"key":"/kvxfer/c/workers/context/x_1-0000000000000001","value":"e30="}`); st != tc.status ||
			st != http.StatusOK && !strings.Contains(body, "lease") {
			t.Errorf("%+v: put without a lease: %d %s, want %d", tc.opts, st, body, tc.status)
		}
		st, body := post("grant", `{"ttl_ms":5000}`)
		var lease int64
		if st != http.StatusOK || func() error { _, err := fmt.Sscanf(body, `{"lease":%d`, &lease); return err }() != nil {
			t.Fatalf("grant: %d %s", st, body)
		}
		if st, body := post("put", fmt.Sprintf(`{"key":"/k","value":"e30=","lease":%d}`, lease)); st != http.StatusOK {
			t.Errorf("%+v: put under a lease: %d %s", tc.opts, st, body)
		}
	}
}
