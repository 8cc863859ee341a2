package connect

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/etcdstore"
	"github.com/kvxfer/kvxfer/membership/membershiptest"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

func block(uri string) config.DisaggCluster {
	return config.DisaggCluster{ClusterURI: uri, ClusterName: "prod", MinContext: 1, MinGeneration: 1, HeartbeatIntervalSec: 5, InactiveTimeoutSec: 10}
}

func TestOpenBuiltIn(t *testing.T) {
	s := memstore.New(memstore.Options{})
	defer s.Close()
	mux := http.NewServeMux()
	mux.Handle(memstore.BasePath+"/", memstore.Handler(s, memstore.HandlerOptions{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	dc := block(srv.URL)
	if !IsBuiltIn(dc) {
		t.Errorf("IsBuiltIn(%s) = false", srv.URL)
	}
	st, err := Open(t.Context(), dc, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	rec := membership.Record{Role: membership.RoleContext, URL: "http://127.0.0.1:9", Layout: membership.Layout{TP: 1, PP: 1, DP: 1}, Incarnation: 1}
	m, err := membership.NewMember(st, rec, MemberOptions(dc))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Register(t.Context()); err != nil {
		t.Fatal(err)
	}
	v := membership.NewView(s, ViewOptions(dc))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); v.Run(ctx) }() //nolint:errcheck // ends with ctx
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(5 * time.Second)
	for len(v.Workers("")) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	ok, why := Ready(v, dc)
	if ok || !strings.Contains(why, "0 of the 1 generation workers") {
		t.Errorf("Ready = %v %q, want the generation role named", ok, why)
	}
	if ws := v.Workers(""); len(ws) != 1 || !strings.HasPrefix(ws[0].Key, "/kvxfer/prod/workers/context/") {
		t.Errorf("workers %+v", ws)
	}
}

func TestOpenEtcd(t *testing.T) {
	addr := membershiptest.StartEtcd(t)
	dc := block("etcd://" + addr + ",etcd://" + addr)
	if IsBuiltIn(dc) {
		t.Error("IsBuiltIn(etcd://) = true")
	}
	st, err := Open(t.Context(), dc, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, ok := st.(*etcdstore.Store); !ok {
		t.Fatalf("Open(etcd://) = %T", st)
	}
	if _, _, err := st.List(t.Context(), membership.Prefix("prod")); err != nil {
		t.Fatal(err)
	}
}

func TestOpenRefuses(t *testing.T) {
	if _, err := Open(t.Context(), block("redis://h:1"), Options{}); err == nil || !strings.Contains(err.Error(), "etcd://") {
		t.Errorf("Open(redis://): %v", err)
	}
}

func TestToken(t *testing.T) {
	a, b := Token([]byte("0123456789abcdef0123456789abcdef")), Token([]byte("0123456789abcdef0123456789abcdeX"))
	if Token(nil) != "" || len(a) != 64 || a == b || strings.Contains(a, "0123456789abcdef") {
		t.Errorf("Token: %q %q", a, b)
	}
}
