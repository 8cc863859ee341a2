package etcdstore

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

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
	membershiptest.Run(t, membershiptest.Harness{
		Addr: addr,
		Dial: func(t testing.TB, addr string) membership.Store { return dial(t, addr) },
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
