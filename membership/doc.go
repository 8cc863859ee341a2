// Package membership is dynamic cluster membership for disaggregated
// serving: TensorRT-LLM's disagg_cluster, with workers that register
// themselves in a store and a router that watches them come and go.
//
// Three parts, one contract:
//
//   - Store is the contract every store keeps (leases, revisions, list and
//     watch from a revision). Two implement it: membership/etcdstore (etcd,
//     for etcd:// cluster URIs) and membership/memstore (kvxfer's built-in
//     store, kept by kvxfer router and reached over HTTP, for http://
//     URIs). Both pass one conformance suite, membership/membershiptest.
//     membership/connect opens the right one for a cluster_uri.
//   - Member is a worker's registration: one Record under
//     /kvxfer/<cluster>/workers/<role>/<member-id>, held by one lease per
//     process and kept alive every heartbeat interval. A keep-alive is
//     retried before the lease can expire, each attempt bounded by the
//     lease time left, so one slow store reply never evicts a live worker;
//     a lease the store lost anyway is granted again and the record put
//     back under the same key.
//   - View is the router's picture: it lists the workers and watches from
//     the listed revision (no join between the two is missed), lists again
//     after a compaction or a broken watch and reports the difference, and
//     keeps per worker URL only the newest incarnation, so the late delete
//     of an older incarnation of a restarted worker changes nothing.
//
// A member id is <host>_<port>-<incarnation>, the incarnation (16 hex
// digits) the time its process started in nanoseconds: a restart on the
// same address is a new member that sorts after the old one.
//
// Constructors start no goroutines. Member.Register starts the one
// keep-alive goroutine, which Deregister and Close stop; View.Run runs in
// its caller's goroutine. Close is idempotent everywhere. Errors that
// callers branch on are the Err* sentinels, matched with errors.Is.
package membership
