package etcdstore

import (
	"context"
	"crypto/tls"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/membershiptest"
)

func dial(t testing.TB, addr string) *Store {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := Dial(ctx, []string{addr}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestConformance runs the suite against a real etcd (Debian's
// etcd-server), started for the test.
func TestConformance(t *testing.T) {
	addr := membershiptest.StartEtcd(t)
	admin := dial(t, addr)
	t.Cleanup(func() { admin.Close() })
	// Connect now: the connection's goroutines must predate the tests'
	// leak checks.
	if _, _, err := admin.List(t.Context(), "/kvxfer/"); err != nil {
		t.Fatal(err)
	}
	runSuite(t, addr, admin, func(t testing.TB, addr string) membership.Store { return dial(t, addr) })
	// Every watcher the suite opened is closed: the server holds none of
	// them, nor their streams (the admin client watches nothing).
	watchesGone(t, addr)
}

// watchesGone fails t unless, within 2 s, the etcd at addr (plain HTTP)
// holds no watcher and no watch stream, as its metrics count them.
func watchesGone(t *testing.T, addr string) {
	t.Helper()
	var got map[string]float64
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		got = map[string]float64{}
		r, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for l := range strings.SplitSeq(string(b), "\n") {
			for _, name := range []string{"etcd_debugging_mvcc_watcher_total", "etcd_debugging_mvcc_watch_stream_total"} {
				if v, ok := strings.CutPrefix(l, name+" "); ok {
					got[name], _ = strconv.ParseFloat(v, 64)
				}
			}
		}
		if len(got) == 2 && got["etcd_debugging_mvcc_watcher_total"] == 0 && got["etcd_debugging_mvcc_watch_stream_total"] == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(got) != 2 || got["etcd_debugging_mvcc_watcher_total"] != 0 || got["etcd_debugging_mvcc_watch_stream_total"] != 0 {
		t.Errorf("etcd's watchers and watch streams after the suite: %v; want both counted, and 0", got)
	}
}

// runSuite runs the conformance suite on the etcd at addr, compacting
// through admin.
func runSuite(t *testing.T, addr string, admin *Store, dial func(t testing.TB, addr string) membership.Store) {
	membershiptest.Run(t, membershiptest.Harness{
		Addr: addr,
		Dial: dial,
		Compact: func(t testing.TB, rev int64) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if _, err := admin.Client().Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil {
				t.Fatalf("compact to %d: %v", rev, err)
			}
		},
		MinTTL: 2 * time.Second,
	})
}

func dialTLS(t testing.TB, addr string, f tlsconf.Files) *Store {
	t.Helper()
	c, err := tlsconf.LoadClient(f.CAFile, f.CertFile, f.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := Dial(ctx, []string{addr}, Options{TLS: c, DialTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestConformanceTLS runs the suite against an etcd that serves TLS only
// and requires client certificates of its CA.
func TestConformanceTLS(t *testing.T) {
	e := membershiptest.StartEtcdTLS(t)
	admin := dialTLS(t, e.Addr, e.Client)
	t.Cleanup(func() { admin.Close() })
	if _, _, err := admin.List(t.Context(), "/kvxfer/"); err != nil {
		t.Fatal(err)
	}
	runSuite(t, e.Addr, admin, func(t testing.TB, addr string) membership.Store { return dialTLS(t, addr, e.Client) })
}

// TestTLSRefused: against an etcd that requires TLS and client
// certificates, a client without TLS, one whose certificate another CA
// signed, and one that does not trust etcd's CA all fail, within the
// operation's deadline, and the error says what happened.
func TestTLSRefused(t *testing.T) {
	e := membershiptest.StartEtcdTLS(t)
	other, err := tlsconf.LoadClient(e.Other.CAFile, e.Other.CertFile, e.Other.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	foreignCert, err := tlsconf.LoadClient(e.Client.CAFile, e.Other.CertFile, e.Other.KeyFile)
	if err != nil {
		t.Fatal(err)
	}
	noCert, err := tlsconf.LoadClient(e.Client.CAFile, "", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		tls  *tls.Config
		want string
	}{
		{"plaintext", nil, "serves TLS only: set security.etcd.ca_file"},
		{"server not trusted", other, "TLS handshake with etcd at " + e.Addr + ": tls: failed to verify certificate"},
		{"client certificate of another CA", foreignCert, "refused this client's TLS: remote error: tls: bad certificate"},
		{"no client certificate", noCert, "refused this client's TLS: remote error: tls: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each waits out most of its deadline (the client retries
			// until then): the four at once.
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			s, err := Dial(ctx, []string{e.Addr}, Options{TLS: tc.tls, DialTimeout: time.Second})
			if err == nil {
				defer s.Close()
				_, _, err = s.List(ctx, "/kvxfer/")
			}
			if err == nil {
				t.Fatal("listed keys of an etcd that should have refused this client")
			}
			t.Logf("error: %v", err)
			if tc.want != "" && !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}

// TestAuth: with etcd's authentication on, the store works as the user
// the options name and fails, saying so, with a wrong password.
func TestAuth(t *testing.T) {
	addr := membershiptest.StartEtcd(t)
	admin := dial(t, addr)
	defer admin.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	cli := admin.Client()
	if _, err := cli.UserAdd(ctx, "root", "root-pw"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := Dial(ctx, []string{addr}, Options{Username: "root", Password: "root-pw"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Put(ctx, "/kvxfer/auth-test", []byte("x"), 0); err != nil {
		t.Fatalf("put as root: %v", err)
	}
	kvs, _, err := s.List(ctx, "/kvxfer/")
	if err != nil || len(kvs) != 1 {
		t.Fatalf("list as root: %v, %v", kvs, err)
	}
	if _, err := Dial(ctx, []string{addr}, Options{Username: "root", Password: "wrong"}); err == nil || !strings.Contains(err.Error(), "authentication failed") {
		t.Errorf("wrong password: %v, want an authentication failure", err)
	}
	anon := dial(t, addr)
	defer anon.Close()
	if _, _, err := anon.List(ctx, "/kvxfer/"); err == nil {
		t.Error("listed without a user on an etcd with authentication on")
	}
}
