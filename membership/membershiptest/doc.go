// Package membershiptest is the conformance suite every membership.Store
// passes (Run), with the test helpers it needs: a TCP proxy that stalls a
// store's replies or the whole connection (StallProxy), and StartEtcd,
// which runs a real etcd from Debian's etcd-server package on free
// loopback ports for the length of a test.
//
// StartEtcd skips the test, with the reason logged, when no etcd binary is
// on PATH, unless KVXFER_REQUIRE_ETCD is set (make test sets it): then it
// fails. Every test of the suite checks with goleak that it leaves no
// goroutine behind once its stores are closed.
package membershiptest
