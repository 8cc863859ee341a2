// Package transporttest is the conformance suite every transport backend
// passes: round trips of many sizes and shapes (contiguous and scattered),
// many concurrent transfers both ways, cancel on both sides before and during
// a transfer, deadlines, Close and peer death in the middle of a transfer, bad
// descriptors, use after Close, and data for unknown tags. Every wait is
// bounded (Limit), and every case ends with a goroutine leak check.
//
// It owns no backend and nothing outside the tests it runs; it imports only
// package transport. A backend's test calls Run with a function that opens
// two transports able to send to each other (two Open calls on loopback for
// tcp):
//
//	func TestConformance(t *testing.T) {
//		transporttest.Run(t, func(t *testing.T) (a, b transport.Transport) {
//			return open(t), open(t)
//		})
//	}
//
// A backend that sends only from memory registered with it (shm) calls
// RunOptions instead, with an Options.Alloc that allocates the suite's
// sources in memory it can register (a sealed memfd); the suite registers
// them with each transport that implements transport.MemoryRegistrar. A
// second run of a backend's suite (TLS, other frame sizes, a wrapper) sets
// Options.SkipLarge: the plain run has done the 256 MiB round trip.
//
// What the suite holds a backend to, beyond the interface documentation:
//   - after Recv.Cancel returns, and after Done, the backend never writes
//     into dst (checked with a canary, and by the race detector);
//   - a Send cancelled before or during a transfer fails its receipt with
//     ErrAborted (or ErrPeerLost), also when no byte had been sent;
//   - a Send whose peer has closed fails with ErrPeerLost; a receipt whose
//     transport closes fails with net.ErrClosed;
//   - a receipt whose sender's transport closes in the middle of a Send
//     that had started fails (ErrAborted, ErrPeerLost or net.ErrClosed);
//   - anything that is not a descriptor of the backend for exactly the
//     bytes offered (garbage, truncated, extended, wrong total) fails Send
//     with ErrBadDescriptor.
//
// Backend exceptions: what a backend cannot do as the suite asks, and how
// it passes anyway (each backend's documentation says more).
//   - mpi: MPI cannot cancel a send in flight. A Send whose ctx ends
//     stops between frames and returns once the (at most four) frames in
//     flight are drained, so "Send cancelled during the transfer" returns
//     up to four frames late (with a receiving rank that has stopped, a
//     paused process, not before it runs again: the drain waits for its
//     copies); a Send that had posted every frame finishes normally (the
//     suite accepts a Send done before its cancel). A
//     receive is cancelled with MPI_Cancel, and the receiving world drains
//     the frames the sender had already posted into scratch memory.
//   - mpi: the suite's "peer death" is a Transport that closes in a live
//     process (the receiving world refuses its receipts: ErrPeerLost). A
//     rank that dies takes the whole MPI world down (mpirun aborts every
//     rank), which the suite cannot run; nor can it run two ranks, so
//     transport/mpi runs it between two Transports of one rank, on every
//     rank of mpirun -np 2, beside cross-rank tests of its own.
package transporttest
