// Package memstore is kvxfer's built-in membership store, for a
// disagg_cluster whose cluster_uri is http://router-host:port: kvxfer
// router keeps a Store in memory and serves it with Handler at BasePath;
// workers reach it with Client. Both Store and Client implement
// membership.Store and pass membership/membershiptest.
//
// The store is bounded: keys, leases, concurrent watchers, HTTP long polls
// (apart, so that they never take the router's own watch) and the value
// size are capped (ErrLimit names the bound), and it keeps a bounded
// history of events, so that a watcher that falls too far behind gets
// ErrCompacted and lists again, as with etcd after a compaction. A lease
// expires by a runtime timer; nothing runs in the background otherwise.
//
// The HTTP protocol is JSON over POST, one call per request; a watch is a
// series of long polls (at most MaxWait each) carrying the revision to go
// on from, so the server keeps no state per client. Every request body is
// decoded with a size bound, unknown fields refused and each field
// checked; answers are decoded the same way on the client. The data is
// lost when the router stops: workers find their leases gone and register
// again, and a restarted router has its picture back within one heartbeat.
package memstore
