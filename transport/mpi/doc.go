// Package mpi is kvxfer's MPI data plane, TensorRT-LLM's deprecated
// `backend: MPI`: non-blocking tagged point-to-point messages (MPI_Isend,
// MPI_Irecv) on OpenMPI, between the ranks of one MPI world that a single
// mpirun started (kvxfer up launches every worker that way, and kvxfer
// serve-mpi gives each world rank its worker). It is cgo, built only with
// the build tag mpi (and cgo, and libopenmpi-dev); without them the package
// is this documentation and the pure-Go wire formats, and package transport
// reports "mpi" as not built in this binary. It registers the backend "mpi"
// from its init function (import it for that effect).
//
// It owns moving bytes between a Send and the memory of an armed receipt;
// it knows nothing of requests, layouts or config, and it does not
// authenticate peers: any rank of the world may send to a descriptor it
// holds.
//
// # A dead peer takes the world down
//
// MPI has no notion of a peer that leaves: when one rank of the world dies,
// OpenMPI's runtime (mpirun) aborts every other rank. A cluster on this
// backend therefore fails as a whole, where tcp, shm and ucx lose only the
// transfers of the peer that went away; kvxfer backends, the README and the
// log line that says why MPI was chosen say so. What the package reports as
// transport.ErrPeerLost is a closed Transport of a live rank. A rank that
// cannot go on calls Abort (kvxfer serve-mpi does), so that the others do
// not wait for it.
//
// # The world
//
// Init (every rank calls it once, first) initialises MPI at
// MPI_THREAD_MULTIPLE, refusing with ErrThreadLevel a library that cannot
// provide it, duplicates MPI_COMM_WORLD twice (a data and a control
// communicator, so that kvxfer's messages never match anyone else's) and
// starts the world's progress goroutine; Finalize stops it and finalizes
// MPI. Every MPI call, MPI_Init_thread and MPI_Finalize included (MPI wants
// both on one thread), is made by that goroutine, locked to its OS thread
// (Abort excepted): Expect, Send, Cancel and Close hand it closures and ring
// its doorbell (a word of C memory, and a channel). While data is in
// flight, and for 2 ms after any work (a completion, a command, a receipt
// armed: the rts and cts of a transfer follow each other closely), it
// waits in C, in one cgo call that loops on MPI_Testsome until a request
// completes, the doorbell rings or a millisecond passes, as MPI_Waitsome
// would (OpenMPI's waits spin too); it then runs the handlers of what
// completed, which post the next frames. Between two tests it yields the
// CPU (sched_yield): the copy of a large message is made inside a test, by
// the receiving rank, so yielding costs the transfer nothing, and the
// threads that must run for the next control message (the transceiver's,
// the peer's) are not starved where ranks share few cores (measured over
// kvxfer bench on two cores: the rts and cts of a request took 2-12 ms
// behind two spinning ranks, 0.03-0.25 ms yielding). A rank whose only
// data in flight are its sends sleeps 50 µs between tests instead
// (nanosleep, still in C): the receiving rank makes the copy, the
// sender's part is to post the next frame when one is acknowledged, a
// frame's copy apart, and a sender spinning beside the copy takes a core
// that the copy or the other threads need (four alternated runs each of
// kvxfer bench --backend mpi --model llama-3.1-8b --isl 4096 --requests
// 24 on two cores, 4 MiB frames: 9.7-11.5 GB/s spinning, 11.1-11.4 sleeping; with
// 16 MiB frames 7.3-11.4 spinning, 11.2-13.1 sleeping; waitNapFor says
// when). Waiting in C rather than testing
// once per turn of a Go loop keeps the locked thread out of Go's
// scheduler: a locked thread that yields is handed between OS threads,
// two context switches each time (perf stat over kvxfer bench --backend
// mpi, 16 requests of 512 MiB: 575,602 context switches before, 27,497
// after). Otherwise it sleeps in Go: at most 250 µs while receipts are
// armed or Sends wait for their receiver, at most 2 ms when only its
// standing control receives are posted (a control message waits that long
// at worst). Open makes a Transport on that world; several may be open in one
// process, each named by its Endpoint "mpi:RANK.ID".
//
// # Protocol
//
// A descriptor names the world (an epoch rank 0 broadcasts at Init), the
// receiving rank, transport and receipt, and the total, with a CRC32-C.
// A Send asks the receiving rank for the receipt with a control message
// (rts); the receiving world claims the receipt for that Send, posts one
// receive per frame on a fresh data tag, from that rank only, and answers
// (cts) with the tag and the frame size (its Options.FrameBytes; at the
// generic default, transport.DefaultFrameBytes, MPI's own FrameBytes: 16
// MiB, fewer rendezvous rounds per transfer). Frame i is bytes [i*F, (i+1)*F) of both sides' concatenated
// pieces; pieces that lie end to end in memory (the consecutive blocks of
// one pool) are one run, so most frames are one contiguous message of
// bytes, and a frame of several runs is one message of an hindexed MPI
// datatype over their addresses (MPI_BOTTOM): there is no staging copy on
// either side. The Send keeps four frames in flight. The pieces are
// pinned (runtime.Pinner) while MPI holds them. A receipt that is closed,
// cancelled, done, or claimed by another Send answers rts with a refusal
// (nack): a closed one fails the Send with transport.ErrPeerLost, the
// others with ErrReceiptGone.
//
// # Registered memory: huge pages
//
// Any memory may be sent or received, but the backend implements
// transport.MemoryRegistrar, through which the transceiver hands it every
// pool arena: RegisterMemory advises the kernel to back the region's
// aligned 2 MiB pages with transparent huge pages (internal/hugepage:
// MADV_HUGEPAGE, then MADV_COLLAPSE for the pages already there; contents
// kept, nothing outside the region touched, best effort, a refusal logged
// once). On one host OpenMPI's vader moves a large message with one cma
// copy (process_vm_readv) by the receiving rank, and the kernel copies 4
// KiB pages (the Go heap's) at about half the speed of huge pages:
// kvxfer bench --backend mpi --model llama-3.1-8b --isl 4096 went from
// 4.25 to 7.6-8.7 GB/s with the advice alone. It then faults the whole
// region in (MADV_POPULATE_WRITE, Linux 5.14; contents kept), as a verbs
// registration does, so that the first transfers into a pool do not fault
// its pages in inside the peer's copy: on this machine (a VM) the first
// 512 MiB request into an untouched pool took 1.3-2.0 s against about
// 0.06 s once the pool was touched, and populating takes that time at
// registration instead. A kernel that cannot populate leaves the first
// touch to the first copy (logged at Debug).
//
// # Cancel and failure
//
// MPI can cancel a receive but not a send in flight. So:
//   - Recv.Cancel (and Close, for every pending receipt) cancels the
//     receipt's frame receives (MPI_Cancel), waits for those already
//     matched to complete, and tells the sender to stop; when Cancel
//     returns nothing writes into dst. The sender answers with how many
//     frames it posted, and the receiving world drains those whose receive
//     was cancelled into scratch memory, so the sender's MPI_Isend
//     complete.
//   - A Send whose ctx ends (or whose transport closes) posts no more
//     frames, tells the receiver how many it posted (the receipt then
//     fails with transport.ErrAborted once those arrived), and returns
//     once the frames in flight are drained: up to four frames later, not
//     at once, and with a receiving rank that has stopped (a paused
//     process) not before it runs again, since the receiver makes the
//     copies. A Send that had posted every frame finishes normally.
//   - A sender or receiver that dies is not one of these cases: see above.
//
// The conformance suite of transport/transporttest passes between two
// Transports of one rank (its messages go through OpenMPI's self
// component): in a world of one under plain go test, and on each rank of
// mpirun -np 2 under make mpi, where the cross-rank tests (round trips
// both ways, scattered pieces, refusals) run between the two ranks over
// the component OpenMPI picks (vader, shared memory, on one host; tcp with
// --mca btl self,tcp), and BenchmarkCrossRank measures them. See the
// suite's list of backend exceptions for what it does not ask of MPI.
package mpi
