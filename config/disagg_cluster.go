package config

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Schemes of disagg_cluster.cluster_uri.
const (
	// SchemeEtcd names an etcd cluster: etcd://h1:2379[,h2:2379...] (each
	// endpoint may repeat the etcd:// prefix, as TensorRT-LLM writes them).
	SchemeEtcd = "etcd"
	// SchemeHTTP names kvxfer's built-in store, kept by the router:
	// http://router-host:port (https:// when the router serves TLS).
	SchemeHTTP  = "http"
	SchemeHTTPS = "https"
)

// MaxClusterEndpoints bounds the endpoints of one cluster_uri.
const MaxClusterEndpoints = 16

// MaxClusterNameLen bounds cluster_name, which is one element of every
// store key (/kvxfer/<cluster_name>/workers/...).
const MaxClusterNameLen = 128

// ClusterURI is a parsed disagg_cluster.cluster_uri.
type ClusterURI struct {
	Scheme string // SchemeEtcd, SchemeHTTP or SchemeHTTPS
	// Endpoints are host:port, in the order written; one for http(s).
	Endpoints []string
}

// ParseClusterURI parses a cluster_uri: etcd://host:port[,host:port...]
// or http(s)://host:port. Every endpoint needs an explicit port; an http
// URI takes no path, query or user.
func ParseClusterURI(s string) (ClusterURI, error) {
	scheme, rest, ok := strings.Cut(strings.TrimSpace(s), "://")
	if !ok || (scheme != SchemeEtcd && scheme != SchemeHTTP && scheme != SchemeHTTPS) {
		return ClusterURI{}, fmt.Errorf("%q: want etcd://host:port[,host:port] (an etcd cluster) or http://host:port (the store kvxfer router keeps; https:// with TLS)", truncate(s))
	}
	u := ClusterURI{Scheme: scheme}
	parts := strings.Split(rest, ",")
	if scheme != SchemeEtcd && len(parts) > 1 {
		return ClusterURI{}, fmt.Errorf("%q: an %s:// cluster_uri names one router, not a list", truncate(s), scheme)
	}
	if len(parts) > MaxClusterEndpoints {
		return ClusterURI{}, fmt.Errorf("%q: %d endpoints, at most %d", truncate(s), len(parts), MaxClusterEndpoints)
	}
	for _, p := range parts {
		p = strings.TrimSpace(p)
		if scheme == SchemeEtcd {
			p = strings.TrimPrefix(p, "etcd://")
		} else {
			p = strings.TrimSuffix(p, "/")
		}
		if err := checkEndpoint(p); err != nil {
			return ClusterURI{}, fmt.Errorf("%q: %w", truncate(s), err)
		}
		u.Endpoints = append(u.Endpoints, p)
	}
	return u, nil
}

// String writes u back in its canonical form.
func (u ClusterURI) String() string {
	return u.Scheme + "://" + strings.Join(u.Endpoints, ",")
}

func checkEndpoint(p string) error {
	if strings.ContainsAny(p, "/?#@ ") {
		return fmt.Errorf("endpoint %q: host:port only (no path, query or user)", truncate(p))
	}
	host, port, err := net.SplitHostPort(p)
	if err != nil || host == "" {
		return fmt.Errorf("endpoint %q is not host:port", truncate(p))
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("endpoint %q has no valid port (1..65535)", truncate(p))
	}
	return nil
}

// CheckClusterName checks cluster_name: it is one element of every store
// key, so no '/', no control characters, at most MaxClusterNameLen bytes.
// The empty name is TensorRT-LLM's default and allowed.
func CheckClusterName(s string) error {
	if len(s) > MaxClusterNameLen {
		return fmt.Errorf("%d bytes, at most %d", len(s), MaxClusterNameLen)
	}
	for _, r := range s {
		if r == '/' || r < 0x20 || r == 0x7f {
			return errors.New("must not hold '/' or control characters: it is one element of the store's keys")
		}
	}
	return nil
}

// CheckHeartbeat is the rule between heartbeat_interval_sec and
// inactive_timeout_sec: 2 × interval ≤ timeout.
//
// The timeout is the lease's TTL; a worker renews the lease every interval.
// When a renewal is sent, the lease has timeout − interval left, and that is
// all the time the worker has to retry a renewal that is slow or lost before
// the store evicts it. The rule keeps that margin at least one whole
// interval (TensorRT-LLM's defaults, 5 s and 10 s, meet it exactly), so one
// slow or failed keep-alive never evicts a live worker; with interval >
// timeout/2 a single lost renewal leaves less than an interval, and the
// membership flaps on any hiccup. It also keeps the TTL at 2 s or more,
// etcd's smallest lease with its default election timeout.
func CheckHeartbeat(intervalSec, timeoutSec int) error {
	if intervalSec < 1 || timeoutSec < 1 || 2*intervalSec > timeoutSec {
		return fmt.Errorf("heartbeat_interval_sec %d and inactive_timeout_sec %d: need 2 × heartbeat_interval_sec ≤ inactive_timeout_sec (e.g. %d and %d), so that a worker can retry a slow or lost keep-alive for at least one interval before its lease expires",
			intervalSec, timeoutSec, max(1, min(intervalSec, timeoutSec/2)), max(2*intervalSec, timeoutSec))
	}
	return nil
}
