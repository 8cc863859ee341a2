package cli

import (
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/serve"
)

// TestBuiltInStoreNoSecretLoopbackMembers: a router whose built-in store
// runs without a cluster secret (allowed on loopback only) routes only to
// members on loopback, as a worker without a secret dials only loopback:
// whoever reaches the store unauthenticated (any local process, or anyone
// through a proxy in front of the router, which the README recommends)
// must not have the router send prompts to a host of its choosing. With a
// secret, the registrants hold it and may advertise any host.
func TestBuiltInStoreNoSecretLoopbackMembers(t *testing.T) {
	for _, tc := range []struct {
		name   string
		secret []byte
		want   []string
	}{
		{"no secret", nil, []string{"http://127.0.0.1:8002", "http://localhost:8003"}},
		{"secret", []byte("0123456789abcdef0123456789abcdef"), []string{"http://10.9.9.9:8001", "http://127.0.0.1:8002", "http://localhost:8003"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dc := &config.DisaggCluster{ClusterURI: "http://127.0.0.1:8000", ClusterName: "c", MinContext: 1, MinGeneration: 1,
				HeartbeatIntervalSec: 1, InactiveTimeoutSec: 3}
			co, closeStore, err := routerMembership(t.Context(), dc, tc.secret, config.EtcdClient{}, "127.0.0.1", 8000, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			defer closeStore()
			r, err := serve.NewRouter(serve.RouterOptions{Cluster: co})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			for i, u := range []string{"http://10.9.9.9:8001", "http://127.0.0.1:8002", "http://localhost:8003"} {
				rec := membership.Record{Role: membership.RoleGeneration, URL: u, Model: "m", Layout: membership.Layout{TP: 1, PP: 1, DP: 1},
					Incarnation: membership.Incarnation(i + 1)}
				id, _ := rec.ID()
				b, err := membership.EncodeRecord(&rec)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := co.Store.Put(t.Context(), membership.Key("c", rec.Role, id), b, 0); err != nil {
					t.Fatal(err)
				}
			}
			var got []string
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				got = got[:0]
				for _, w := range r.ClusterInfo().CurrentWorkers["generation_servers"] {
					got = append(got, w.URL)
				}
				if len(got) >= len(tc.want) {
					break
				}
			}
			time.Sleep(50 * time.Millisecond) // a late join would show now
			got = got[:0]
			for _, w := range r.ClusterInfo().CurrentWorkers["generation_servers"] {
				got = append(got, w.URL)
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("generation members %v, want %v", got, tc.want)
			}
		})
	}
}
