package config

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParseClusterURI(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ClusterURI
		err  string
	}{
		{in: "etcd://127.0.0.1:2379", want: ClusterURI{SchemeEtcd, []string{"127.0.0.1:2379"}}},
		{in: "etcd://h1:2379,h2:2379", want: ClusterURI{SchemeEtcd, []string{"h1:2379", "h2:2379"}}},
		{in: "etcd://h1:2379,etcd://h2:2379", want: ClusterURI{SchemeEtcd, []string{"h1:2379", "h2:2379"}}},
		{in: "etcd://[::1]:2379", want: ClusterURI{SchemeEtcd, []string{"[::1]:2379"}}},
		{in: "http://router:8000", want: ClusterURI{SchemeHTTP, []string{"router:8000"}}},
		{in: "http://router:8000/", want: ClusterURI{SchemeHTTP, []string{"router:8000"}}},
		{in: "https://router:8443", want: ClusterURI{SchemeHTTPS, []string{"router:8443"}}},
		{in: "redis://h:1", err: "want etcd://host:port"},
		{in: "h:2379", err: "http://host:port"},
		{in: "etcd://h", err: "not host:port"},
		{in: "etcd://h:0", err: "no valid port"},
		{in: "etcd://h:2379,", err: "not host:port"},
		{in: "http://a:1,b:2", err: "names one router"},
		{in: "http://r:80/path", err: "host:port only"},
		{in: "http://u@r:80", err: "host:port only"},
		{in: "etcd://" + strings.Repeat("h:1,", 20) + "h:1", err: "at most 16"},
	} {
		got, err := ParseClusterURI(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseClusterURI(%q) = %v, %v; want error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || !cmp.Equal(got, tc.want) {
			t.Errorf("ParseClusterURI(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestCheckHeartbeat(t *testing.T) {
	for _, tc := range []struct {
		interval, timeout int
		ok                bool
	}{
		{5, 10, true}, {1, 2, true}, {3, 30, true}, {5, 9, false}, {10, 10, false}, {1, 1, false}, {0, 10, false}, {11, 10, false},
	} {
		err := CheckHeartbeat(tc.interval, tc.timeout)
		if (err == nil) != tc.ok {
			t.Errorf("CheckHeartbeat(%d, %d) = %v, want ok %v", tc.interval, tc.timeout, err, tc.ok)
		}
		if err != nil && (!strings.Contains(err.Error(), "heartbeat_interval_sec") || !strings.Contains(err.Error(), "inactive_timeout_sec")) {
			t.Errorf("CheckHeartbeat(%d, %d) = %v: the message names neither key", tc.interval, tc.timeout, err)
		}
	}
}

// TestDisaggClusterBlock: the block's defaults, in both file forms, and
// what the loader refuses.
func TestDisaggClusterBlock(t *testing.T) {
	for _, tc := range []loadCase{
		{"disagg_cluster: {cluster_uri: 'etcd://h1:2379,h2:2379'}\n", KindCluster, 0, "", ""}, // applied: no warning
		{"disagg_cluster: {cluster_uri: 'redis://h:1'}\n", KindCluster, SevError, "disagg_cluster.cluster_uri", "etcd://"},
		{"disagg_cluster: {cluster_uri: 'redis://h:1'}\n", KindCluster, SevError, "disagg_cluster.cluster_uri", "http://"},
		{"disagg_cluster: {cluster_uri: 'etcd://h'}\n", KindCluster, SevError, "disagg_cluster.cluster_uri", "not host:port"},
		{"disagg_cluster: {cluster_uri: 'etcd://h:1', cluster_name: 'a/b'}\n", KindCluster, SevError, "disagg_cluster.cluster_name", "'/'"},
		{"disagg_cluster: {cluster_uri: 'etcd://h:1', heartbeat_interval_sec: 6}\n", KindCluster, SevError, "disagg_cluster.heartbeat_interval_sec",
			"heartbeat_interval_sec 6 and inactive_timeout_sec 10: need 2 × heartbeat_interval_sec ≤ inactive_timeout_sec"},
		{"disagg_cluster: {cluster_uri: 'etcd://h:1', inactive_timeout_sec: 9}\n", KindCluster, SevError, "disagg_cluster.heartbeat_interval_sec", "inactive_timeout_sec 9"},
		{"disagg_cluster: {cluster_uri: 'etcd://h:1', heartbeat_interval_sec: 2, inactive_timeout_sec: 4}\n", KindCluster, 0, "", ""},
		{"cache_transceiver_config: {backend: TCP}\ndisagg_cluster: {cluster_uri: 'http://r:8000', inactive_timeout_sec: 6}\n", KindWorker, SevError,
			"disagg_cluster.heartbeat_interval_sec", "need 2 × heartbeat_interval_sec"},
		{"disagg_cluster: {cluster_uri: 'etcd://h:1', minimal_instances: {context_servers: 2, decoders: 1}}\n", KindCluster, SevError,
			"disagg_cluster.minimal_instances.decoders", "unknown key"},
	} {
		tc.check(t)
	}

	f, err := loadText(t, "disagg_cluster: {cluster_uri: 'etcd://h:2379'}\n")
	if err != nil {
		t.Fatal(err)
	}
	want := &DisaggCluster{ClusterURI: "etcd://h:2379", MinContext: 1, MinGeneration: 1, HeartbeatIntervalSec: 5, InactiveTimeoutSec: 10}
	if f.Cluster == nil || !cmp.Equal(f.Cluster.DisaggCluster, want) {
		t.Errorf("defaults: got %+v, want %+v", f.Cluster, want)
	}
	if f.Cluster.Context.NumInstances != 0 || f.Cluster.Generation.NumInstances != 0 {
		t.Errorf("a cluster file with disagg_cluster lists no instances: got %d and %d", f.Cluster.Context.NumInstances, f.Cluster.Generation.NumInstances)
	}
}
