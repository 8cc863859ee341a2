// Package faultinject wraps a transport.Transport with faults chosen by a
// Plan: every Nth Send or Expect fails (with an error that unwraps to
// transport.ErrPeerLost, as a lost peer's does), is delayed, is truncated,
// or is held back so that later operations complete first (reordered).
// Which operations are hit is a pure function of the plan and its seed, so
// a run can be repeated.
//
// The fault kinds, per operation:
//
//   - fail: Send returns before sending anything; Expect returns no receipt.
//     Both errors unwrap to transport.ErrPeerLost.
//   - delay: the operation waits Plan's duration first (Send gives up when
//     its context ends).
//   - truncate: Send hands the backend one byte fewer than the receiver
//     armed, which every backend refuses before any byte moves
//     (transport.ErrBadDescriptor: the total is part of the descriptor);
//     an Expect's receipt, once its bytes are in place, loses the tail (it
//     is zeroed) and fails with an error that unwraps to
//     transport.ErrPeerLost, as a receipt whose sender died partway does.
//     Neither side ever reports a short transfer as complete.
//   - reorder: the operation is held until a later operation of the same
//     kind on this transport has completed (at most the rule's duration,
//     default 50 ms), then runs.
//
// Tests wrap a transport with Wrap, or a transceiver's data planes with
// transceiver.Options.WrapDataPlane. kvxfer built with the build tag chaos
// (internal/cli/chaos.go) wraps its worker's data planes with the plan in
// the environment variable KVXFER_FAULTS (FromEnv), so a worker's config
// stays as upstream writes it (backend TCP, UCX, ...); a normal binary does
// not contain this package.
//
// faultinject imports only package transport.
package faultinject
