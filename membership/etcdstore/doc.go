// Package etcdstore is the membership store on etcd, for disagg_cluster
// URIs etcd://h1:2379[,h2:2379...]. It implements membership.Store with
// go.etcd.io/etcd/client/v3 and passes membership/membershiptest against a
// real etcd (Debian's etcd-server 3.4 and later).
//
// Leases map to etcd leases (whole seconds, rounded up; etcd grants at
// least its minimum TTL, 2 s with a default election timeout) and are
// renewed one keep-alive at a time (KeepAliveOnce): the client's own
// keep-alive stream is not used, so the Member decides when to renew and
// how long to wait. Watches ask for a leader (WithRequireLeader), so a
// watch on a member cut off from its cluster breaks instead of going
// silent, and the View lists again.
//
// Options.TLS and Username/Password reach an etcd that serves TLS (with
// client certificates) or has its authentication on. The etcd client
// reports a refused TLS handshake only as a deadline; on a failed
// operation the store probes the first endpoint itself (at most once per
// 5 s, within a second) and adds what it found to the error.
package etcdstore
