// Package freeport picks loopback TCP ports for processes that must be told
// their port before they bind it (etcd, iperf3, workers under mpirun, test
// clusters).
//
// A port chosen by binding port 0 lies in the kernel's ephemeral range,
// which every outgoing connection and every other port-0 bind on the host
// draws from, so it is often taken again before its new owner binds it.
// The ports here lie below the ephemeral range, where only explicit binds
// land, and one process never hands out the same port twice. When a
// process can pass on an open socket instead, it should (kvxfer up hands
// its workers their HTTP socket).
package freeport
