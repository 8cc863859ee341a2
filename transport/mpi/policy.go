package mpi

import (
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// FrameBytes is the size of one MPI message of a transfer when the
// Options leave it at transport.DefaultFrameBytes: 16 MiB. On one host
// OpenMPI's vader moves each large message with one cma copy by the
// receiving rank, and every message costs a round of its rendezvous (the
// sender's header, the receiver's acknowledgement, the sender's next
// post); larger frames mean fewer rounds per transfer (32 instead of 128
// for 512 MiB). Measured over kvxfer bench --backend mpi --model
// llama-3.1-8b --isl 4096 --requests 24, four alternated runs each:
// 11.2-13.1 GB/s with 16 MiB frames, 11.1-11.4 with 4 MiB (the sender
// sleeping between tests in both; see waitNapFor).
const FrameBytes = 16 << 20

// frameBytesFor is the frame size of a Transport opened with Options
// whose FrameBytes (after transport.Options.WithDefaults) is opt: MPI's
// own FrameBytes for the generic default, opt as given otherwise.
func frameBytesFor(opt int) int {
	if opt == transport.DefaultFrameBytes {
		return FrameBytes
	}
	return opt
}

// sendNap is how long the progress goroutine sleeps between two tests
// while this rank's only data in flight are sends (see waitNapFor).
const sendNap = 50 * time.Microsecond

// waitNapFor is how the progress goroutine waits between two tests in C,
// given the data receives and sends it has in flight and whether a Send
// waits for its cts: 0 (yield the CPU, sched_yield, and test again at
// once) while it receives data (vader's single copy is made by the
// receiving rank, inside its tests), while a Send waits for its cts, or
// with no data in flight (after work: a control message may follow);
// sendNap, sleeping, when its only data in flight are sends. Then the
// receiving rank is copying: a sender that spins beside the copy takes a
// core that the copy, or the threads of either process, need where cores
// are few, and the receiver's acknowledgements come a frame's copy apart
// (about 1.2 ms for 16 MiB), with sendWindow-1 frames queued behind each,
// so a sender that looks every sendNap keeps it fed.
func waitNapFor(recvs, sends int, awaitingCTS bool) time.Duration {
	if recvs > 0 || sends == 0 || awaitingCTS {
		return 0
	}
	return sendNap
}
