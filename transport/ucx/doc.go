// Package ucx is kvxfer's UCX data plane: UCP tagged messages (UCX 1.13,
// the *_nbx API), registered as the transport backend "ucx" by its init
// function (import it for that effect). It is cgo, built only with the build
// tag ucx (and cgo, and libucx-dev); without them the package is this
// documentation and the pure-Go wire formats, and package transport reports
// "ucx" as not built in this binary.
//
// It owns moving bytes between a Send and the memory of an armed receipt
// through one UCP context and worker per Transport; it knows nothing of
// requests, layouts or config. Like the tcp backend it does not
// authenticate peers beyond the unguessable tag in a descriptor.
//
// # Threading
//
// Each Transport has one progress goroutine that creates the context and
// the worker and is the only goroutine that ever calls into them; the
// worker is created with UCS_THREAD_MODE_SERIALIZED because Go may run that
// goroutine on a different OS thread between two calls (one caller at a
// time is all SERIALIZED asks). Expect, Send, Cancel and Close hand it
// closures through a queue and wait on channels; a submitter wakes a
// sleeping loop with ucp_worker_signal, which UCX documents as safe from
// any thread. UCX callbacks run inside ucp_worker_progress and only append
// events to a C array, which the goroutine drains after each progress (no
// C-to-Go callbacks). When a round finds nothing to do 64 times in a row,
// the goroutine arms the worker (ucp_worker_arm) and sleeps in Go's
// netpoller on a dup of UCX's event fd (ucp_worker_get_efd), at most
// 100 ms (UCX's keepalive runs from progress); but while a Send or a
// receipt is in flight and no endpoint has a tcp lane, it polls on for up
// to 2 ms since its last progress before it sleeps (a shared-memory
// transfer's steps follow each other closely, and a sleep between them
// costs a wakeup, of a halted CPU too on a virtual machine: 8.11 GB/s
// sleeping, 8.88 spinning, kvxfer bench, 512 MiB requests, eight
// alternated runs each; over loopback tcp no gain, so no spin). Sleeping in a C poll instead
// would keep the goroutine's P until sysmon takes it back, and on a
// machine with few cores the goroutines waiting for a Send or a receipt
// would wait for that too (measured: 150 µs a message). After a round that
// ends Sends or receipts, the goroutine yields (runtime.Gosched): their
// waiters were made runnable behind it on its P (a 1 KiB Send: 50 µs
// before, 6 µs after). An idle Transport costs a few wakeups a second.
//
// # Endpoints, receipts and tags
//
// Endpoint is base64 of a version byte, the transport's random 64-bit
// instance id and its UCP worker address (ucp_worker_get_address, 215 bytes
// with every local transport; 79 with UCX_TLS=tcp), so a descriptor is
// about 250 bytes, far below transport.MaxDescriptorBytes. A machine whose
// address makes the descriptor exceed it (many devices) gets an error from
// Expect; restrict the devices with UCX_NET_DEVICES.
//
// Expect draws a random tag base (48 random bits, the low 16 bits zero) and
// cuts dst into messages: every segment of at least 256 KiB is a message of
// its own, contiguous, so that UCX moves it by zero-copy rendezvous (cma
// between processes of one host, RDMA where there is a NIC for it); runs of
// smaller segments are gathered into messages of about 4 MiB described with
// the UCP iov datatype (ucp_dt_make_iov); at most 512 messages (neighbours
// are merged beyond). Message i has tag base|i. The descriptor carries
// version, tag base, total, the message lengths and the receiver's
// endpoint. The receives are posted, exact-match, by the progress goroutine
// before its next progress; Expect does not wait for that (its tag stays
// marked pending until then, see below). Send splits src at the receiver's message
// boundaries and tag-sends every message at once: contiguous when a message
// falls in one src segment, iov otherwise. (UCX 1.13 uses zero-copy
// rendezvous only when both sides are contiguous; an iov message goes by
// active messages.) The endpoint to a receiver is created on first use
// (UCP_ERR_HANDLING_MODE_PEER, an error handler) and cached by receiver
// endpoint; it is closed when the peer is lost, and the next Send
// reconnects. Source and destination memory is pinned (runtime.Pinner)
// while UCX holds pointers to it.
//
// A tagged message that no posted receive matches belongs to no live
// receipt (receives are posted before their tag leaves Expect): the
// progress goroutine receives it into 256 bytes of scratch memory, which
// truncates it, so UCX completes its sender (a rendezvous sender gets its
// acknowledgement). A Send to a receipt that was cancelled, has completed,
// or never existed thus succeeds and writes nothing, as with tcp. (A
// message for a receipt whose receives are still being posted is left in
// the queue for them.)
//
// Besides tagged data, transports exchange small control messages (UCP
// active messages): HELLO on every new endpoint, carrying the sender's
// endpoint so that the receiver connects back (acks and goodbyes need an
// endpoint of its own: UCP's reply endpoint is not safe to keep); ABORT
// from a sender that stops, ACK in reply, and BYE from a transport that
// closes.
//
// # Cancel
//
// UCX 1.13 cannot cancel a send (ucp_request_cancel acts only on tagged
// receives still in the expected queue), nor a receive that an incoming
// message has already matched.
//
// Send whose ctx ends: if every message has completed, Send returns nil.
// Otherwise it sends ABORT to the receiver and waits for both the
// receiver's ACK and the completion of every message (UCX reads src until
// then). The receiver fails the receipt with transport.ErrAborted and
// answers "aborted", or, when the receipt had already completed with every
// byte in place, answers "completed", and Send then returns nil: a Send
// returns an error only if its receipt fails. Messages the receiver no
// longer expects are dropped as above, so the sends complete. A Send whose
// ctx has ended before it starts sends only the ABORT. When ACK and
// completions do not come within 2 s (a receiver alive but not
// progressing), the endpoint is closed by force: UCX fails every request on
// it, and every Send on it returns (with ErrPeerLost, or the ctx error for
// the aborted ones). The ABORTs queued on it go with it, so an ABORT for
// each of those Sends that had no answer is queued again on a fresh
// endpoint, which UCX holds until the receiver wires it up: a receiver
// that stalled before it had (a paused process) fails those receipts when
// it runs again, rather than at its own deadline. The error wraps ctx's: a *transport.TimeoutError for a
// deadline. The transfer itself is not shortened: UCX carries on with a
// message it has started; over tcp the ABORT even queues behind the data, so
// a Send cancelled mid-way usually completes and returns nil.
//
// Recv.Cancel: the receipt fails with transport.ErrCanceled; every receive
// still in the expected queue is cancelled (ucp_request_cancel, which
// completes it with UCS_ERR_CANCELED at once), and Cancel waits for the
// completion callback of every one: a receive already matched is not
// cancellable and runs to its end (or fails), so after Cancel returns UCX
// writes nothing into dst. The sender is not told; its later messages are
// dropped and its Send succeeds.
//
// # Failure
//
// Endpoints use UCP_ERR_HANDLING_MODE_PEER. A peer process that dies is
// reported by UCX: a broken tcp connection at once; over shared memory by
// UCX's keepalive (it checks that the peer process exists; a dead process
// that its parent has not reaped still exists), every KEEPALIVE_INTERVAL,
// which this backend sets to 1 s unless UCX_KEEPALIVE_INTERVAL is set. The
// endpoint's error handler then fails every Send on it with ErrPeerLost and
// the endpoint is closed. On the receiving side UCX fails a receive it has
// matched to the dead peer (a cma read of a dead process fails at once, a
// rendezvous is failed with its endpoint); the receipt fails with
// ErrPeerLost. A receipt whose sender died before its messages arrived is
// bound to nobody: only the caller's deadline ends it (Cancel). A transport
// that closes while its process lives is not seen by UCX (the process
// exists): BYE tells its peers, which fail their Sends to it with
// ErrPeerLost; a new endpoint to a closed transport fails at once
// (UCX: "Shared memory error", "Destination is unreachable").
//
// Close aborts the Sends in flight (as above, bounded by 2 s), fails
// pending receipts with a *transport.ClosedError (waiting, within the same
// 2 s, for matched receives to end), sends BYE to every peer, closes every
// endpoint by force, destroys the worker and the context (after which UCX
// holds no pointer to Go memory), ends whatever is left, and returns once
// the progress goroutine has.
//
// # Which transports UCX uses, and shared memory with error handling
//
// Name reports "ucx(<transports>)": the UCX transports of the lanes of the
// endpoints made so far, in the order first seen, such as "ucx(sysv,cma)"
// (shared-memory active messages, cma zero-copy reads) or "ucx(tcp)".
// UCX 1.13 has no ucp_ep_query field for it, so the backend reads the lane
// table that ucp_ep_print_info writes, and logs it (Info) for every new
// endpoint. PeerTransports gives one endpoint's transports.
//
// In UCX 1.13 UCP_ERR_HANDLING_MODE_PEER excludes the shared-memory
// transports unless they are told to expose error handling: sysv and posix
// report "no peer failure handler" unless UCX_{MM,SYSV,POSIX}_ERROR_HANDLING
// is y, and cma is refused as a rendezvous lane unless
// UCX_CMA_MEMORY_INVALIDATE is y. Left alone, every peer on the same host
// silently talks tcp over loopback at half the speed, or less. The backend
// therefore sets, through ucp_config_modify, MM_ERROR_HANDLING=y and
// MEMORY_INVALIDATE=y (and KEEPALIVE_INTERVAL=1s), each only when none of
// the environment variables that set it is present, and NET_DEVICES from
// the listen host unless UCX_NET_DEVICES is set (see Listening); everything
// else (UCX_TLS, thresholds, ...) is read by UCX itself from the environment
// (ucp_config_read) and never overridden. What the knobs give up:
// with cma, after a failed rendezvous the peer could still read (never
// write) the source memory; the cma "invalidate" is declared, not done. The
// receiver reads with cma itself, so no peer writes into a receiver's
// memory.
//
// # Listening
//
// UCX's tcp transport listens on the address of every network device the
// context uses (ports of its choosing), so a backend left alone listens on
// every interface of the machine whatever address it was asked for. The
// host of Options.ListenAddr therefore chooses the devices, given to UCX as
// NET_DEVICES: a loopback host (127.0.0.1, localhost) gives only the
// loopback device (peers on the same host still use shared memory; nothing
// listens where another machine can reach it); another host gives the
// devices that hold that address, plus the machine's RDMA ports (from
// /sys/class/infiniband), which open no socket; an IPv6 host also sets
// tcp's AF_PRIO to inet6, since UCX binds a device's IPv4 address when it
// has one. 0.0.0.0, :: or an empty host leave every device. A host that is
// no interface's address fails Open. Options.Interface (the transceiver
// passes TRTLLM_UCX_INTERFACE) replaces the host with the interface's first
// IPv4 address (its first address when it has none); an interface the
// machine does not have fails Open, naming those it has. The backend has no
// side channel of its own: worker addresses travel in descriptors over the
// transceiver's control plane, which listens where the transceiver says. UCX binds a device's first address of
// the family: a host that is a device's secondary address is not bound as
// such. UCX_NET_DEVICES in the environment wins (the backend logs a warning
// when it overrides a specific host). ListenAddrs reports the host and
// devices ("127.0.0.1 (lo)"); UCX does not report its ports. The
// shared-memory transports (sysv, posix, cma) open no socket; a peer on the
// same host reaches them through the worker address in a descriptor.
//
// The port of ListenAddr, Streams and FrameBytes do not apply. The backend
// does not implement transport.Prober (UCX reaches any host it has a device
// for).
//
// # Registered memory: huge pages
//
// Tagged operations need no registration (UCX's registration cache covers
// RDMA), but the backend implements transport.MemoryRegistrar, through
// which the transceiver hands it every pool arena: RegisterMemory advises
// the kernel to back the aligned 2 MiB pages inside the region with
// transparent huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE for the pages
// already there, about 2.5 s a GiB here, once; contents kept, nothing
// outside the region touched, best effort: a kernel without transparent
// huge pages leaves the memory as it is, logged once). The pools are Go heap memory in 4 KiB pages, and cma (the
// shared-memory rendezvous) copies those at about half the speed: measured
// with kvxfer bench (llama-3.1-8b, identical layouts, one process each
// side, UCX_TLS unset), 4.96, 4.61 and 6.46 GB/s at 128 MiB, 512 MiB and
// 2 GiB per request before, 7.61, 9.85 and 10.72 GB/s after; a C loop of
// 512 KiB process_vm_readv calls between two processes reads 4.3 GB/s from
// 4 KiB pages and 7.5-9 GB/s from huge pages.
//
// # tcp receive buffers
//
// UCX's tcp transport receives into a buffer of UCX_TCP_RX_SEG_SIZE bytes,
// 64 KiB by default, one recv call each; with error handling (see below)
// all its data travels as active messages through that buffer. The backend
// sets RX_SEG_SIZE to 1 MiB unless UCX_TCP_RX_SEG_SIZE or
// UCX_TCP_TX_SEG_SIZE is set (UCX refuses a receive buffer smaller than its
// send segments): with UCX_TLS=tcp, 512 MiB per request, 2.85 GB/s before
// and 5.25 after (256 KiB: 3.7, 4 MiB: 3.6, measured with
// UCX_TCP_RX_SEG_SIZE). Each tcp endpoint holds one such buffer. UCX's tcp
// also sends active messages as long as its own receive buffer (zero-copy
// eager sends), and a process that receives one longer than its buffer
// aborts (a UCX assertion): every process must have the same size, as UCX
// itself requires of its configuration. Endpoints of this version (2) are
// therefore refused by transports of the previous one, which used UCX's
// 64 KiB, and the other way round (a bad-descriptor error, not an abort);
// a UCX_TCP_RX_SEG_SIZE in the environment must be the same everywhere.
//
// # Comparing with ucx_perftest and ucx_c
//
// BenchmarkSend moves one message at a time between two transports of one
// process (Expect, Send, wait for the receipt); BenchmarkSendProcess puts
// the receiver in another process, with one message of 4 MiB or 512 MiB,
// or (512MiB_4MiBx128) 512 MiB in 4 MiB segments on both sides, the shape
// of a llama-3.1-8b request of 4096 tokens in kvxfer bench: 128 messages
// in flight at once. Their "thp" memory is anonymous memory
// with MADV_HUGEPAGE, as registered pools are; "goheap" is make([]byte),
// which cma copies at about half the speed. ucx_perftest's own buffers
// come from ucp_mem_map, which on a host with shared memory allocates
// System V shared memory in 4 KiB pages (ucx_info -u t -m 536870912);
// with UCX_ALLOC_PRIO=thp it gets huge pages but never writes them, so it
// reads the kernel's huge zero page, which stays in cache (16-22 GB/s
// here, faster than a memcpy of real data): not a fair ceiling. The
// same message sizes with UCX's own benchmark, two processes, same UCX_TLS:
//
//	ucx_perftest -p 13337 &                                    # server
//	ucx_perftest localhost -p 13337 -t tag_bw -s 4194304 -n 1000
//	ucx_perftest localhost -p 13337 -t tag_bw -s 536870912 -n 16
//
// kvxfer bench --baseline measures, besides ucx_perftest, ucx_c: a C UCP
// program (bench/csrc/ucxbw.c) that moves the same bytes between two
// processes as tagged messages on memory both have written, on huge pages
// or 4 KiB pages, 4 MiB messages (all in flight, or 8), 16 MiB, or one
// message, busy polling, and reports the best setting; the UCX targets
// divide by the higher of the two. Measured here under an exclusive lock,
// alternated three times, 512 MiB: BenchmarkSendProcess/512MiB_4MiBx128/thp
// 7.26, 9.05 and 10.39 GB/s against ucx_c's "4 MiB x 128 in flight, thp"
// 7.86, 10.50 and 10.49 (UCX_TLS=tcp: 3.92, 4.60, 4.41 against 4.20,
// 4.40, 4.53): the transport alone is within 0.86-1.05 of UCX's own loop,
// run to run, before the spin above. Error handling costs UCX nothing
// measurable here (ucx_c with UCP_ERR_HANDLING_MODE_PEER and the two
// knobs below: 10.0 and 11.8 GB/s against 9.9 and 11.2 without).
//
// With the error handling this backend needs (and its two shared-memory
// knobs), which is the fair comparison, on both sides of the command:
//
//	UCX_MM_ERROR_HANDLING=y UCX_CMA_MEMORY_INVALIDATE=y ucx_perftest ... -e
//
// Over tcp the lanes differ: without error handling UCX 1.13 gives tcp
// rendezvous lanes (put zero-copy, one per interface), with it only active
// messages. Measured here (tag_bw, 16 MiB, three runs each), the cost is
// small: 3.9-4.6 GB/s without -e, 3.7-4.1 with; with -e and 1 MiB
// segments (UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE) 5.5-6.9. Without
// the put lane the receiver copies every fragment out of UCX's receive
// buffer: in kvxfer bench over tcp that memmove is 28.6% of the receiving
// process's CPU samples, the kernel's receive copy 19.5% (ucx_c's receiver
// has only the latter), and still kvxfer's median request moves at ucx_c's
// rate (docs/perf-notes.md, "What UCX's gap to ucx_c is made of").
package ucx
