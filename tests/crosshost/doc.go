// Package crosshost holds the cross-host tests of disaggregated serving
// (issue #15): etcd and the router in one network namespace and each
// worker in its own, joined by veth pairs to a bridge, so that every byte
// between the router, the workers and their transceivers crosses a real
// (virtual) network and never a shared loopback or abstract Unix socket.
// It runs the disaggregated flow over TCP, UCX (with -tags ucx) and AUTO,
// injects faults (latency, a bandwidth limit, resets, a stall) between the
// context and generation workers' namespaces with a userspace proxy, and
// restarts workers one at a time under load. The tests need root and
// iproute2's ip; without them they skip, saying why, unless
// KVXFER_REQUIRE_NETNS=1. The package has no code outside its tests.
package crosshost
