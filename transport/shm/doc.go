// Package shm is kvxfer's same-host shared-memory data plane, registered as
// the transport backend "shm" by its init function (import it for that
// effect). It needs Linux; elsewhere the name is registered as unavailable.
//
// It owns moving bytes between a Send and the memory of an armed receipt
// of another transport on the same host; it knows nothing of requests,
// layouts or config. Like tcp, it does not authenticate peers beyond the
// unguessable tag in a descriptor: whoever can hand a sender a descriptor
// (the transceiver's control plane decides who can) becomes a receiver.
//
// # What a peer can reach
//
// A receiver gets the bytes of the Sends addressed to it, read-only, and
// nothing else. No pool, staging buffer or other memory of the sender is
// ever shared: each connection a sender dials has a window of its own, a
// sealed memfd of 8 slots of (at most) 1 MiB that the sender maps writable,
// then seals with F_SEAL_FUTURE_WRITE (besides shrink, grow and seal), so
// that no descriptor of it — the one passed to the receiver, or one reopened
// through /proc — can write it or map it writable. The sender copies each
// part of a Send into a free slot and tells the receiver; the receiver,
// which maps the window read-only, copies the part into the receipt's memory
// and releases the slot. A window only ever holds bytes of Sends to its one
// receiver, so a receiver that keeps its mapping learns nothing it was not
// sent. Nobody writes into another process's memory, so a receiver can
// always stop, and a sender never depends on a receiver for its own memory.
//
// The price is a second copy: the sender's (source → window) and the
// receiver's (window → destination) run in parallel on two processes, on a
// window small enough to stay in a shared cache. The sender fills a slot
// in copies of at most 512 KiB: Go's copy writes around the caches from
// 1 MiB on, which would send every slot to memory and back. The receiver's
// copy out of a slot writes around them, as the destination is not read
// again soon.
//
// # Endpoints, connections, windows
//
// Each Transport listens on an abstract Unix socket named "@kvxfer-shm-"
// and 128 random bits in hex: abstract sockets leave no file behind and
// exist per network namespace, so reaching one proves that both sides share
// a host and a namespace. A sender dials, lazily, one connection per
// receiver endpoint, exchanges HELLOs (magic, version) and announces its
// window: WINDOW with the slot size and count, the memory file attached
// (SCM_RIGHTS). The file holds the slots and, after them, a ring where the
// sender posts parts. The receiver maps it read-only (internal/memfd.MapReadOnly
// checks the seals that make a mapping safe from SIGBUS) for the life of
// the connection, or answers ERR for op 0 with the reason it cannot (the
// Sends on that connection fail with ErrRefused, saying why); when
// the connection ends, or the transport closes, both sides unmap it, after
// the copies using it have stopped.
//
// Sources need no registration, destinations neither; RegisterMemory only
// advises the memory to transparent huge pages (internal/hugepage), which
// makes both copies faster than on the Go heap's 4 KiB pages: in one
// process, 512 MiB from and to huge pages moved 11.2-13.4 GB/s where the
// same Send between memory files of 4 KiB pages moved 9.7-11.1 in the same
// runs (BenchmarkSend, shm-thp and shm). Between two processes (kvxfer
// bench) the difference was lost in the noise of a shared machine.
//
// # Why not one copy
//
// vmsplice of the sender's pages into a pipe whose read end the receiver
// holds would keep every peer to its own bytes with a single copy (the
// receiver's read), but the kernel's pipe read moves a page at a time:
// BenchmarkVmsplice, 512 MiB between two processes (two runs), moved
// 8.6-9.5 GB/s from huge pages through one 1 MiB pipe, 11.3-13.0 GB/s
// through two read on two goroutines, 4.7-5.4 GB/s from 4 KiB pages,
// where a copy of the same bytes moved 21.4-21.5 GB/s in the same runs:
// 0.53-0.60 of a copy at best, no better than the window's 0.57-0.69 of
// one (kvxfer bench, whose copy baseline runs on the Go heap's small pages
// and is the slower), for a protocol that would have to revoke what a
// pipe holds. Pipes keep the huge pages whole (the source is still all
// huge pages after the rounds).
//
// # Ops
//
// A Send is one op on the connection: parts (op id, the receipt's tag,
// the op's total length, the part's offset in the receipt, its slot and
// length), in order, the last one flagged, each posted in the window's
// ring once its bytes are in its slot: an entry, then the count of parts
// posted. A worker goroutine per connection takes them from the ring: it
// copies each entry out of the window, then checks it (slot in range and
// not held, length within a slot, offsets in sequence, the count never
// more than a window ahead nor going back) and binds the op to the receipt
// of the tag at its first part (checking the length); it copies each part
// into the receipt, releases its slot (RELEASE), and after the last
// answers DONE. A refusal (unknown tag, another length, a receipt being
// filled or cancelled) is answered ERR at once, with a code and a reason;
// later parts of that op are released unread, and the sender, which stops
// at the ERR, ends the op with CANCEL. The receipt completes as the
// receiver writes DONE, and Send returns nil when it reads it (protocol 3 completed
// the receipt only at the sender's ACK of DONE: a third one-way hop, and a
// wake-up of each process, per op). Wire formats are in wire.go.
//
// Parts cost no message and no wake-up while both sides are busy: a
// worker that finds the ring empty while an op still has parts to come
// looks again for up to 100 µs (yielding its CPU between looks) before it
// says IDLE and sleeps, and only a sender that saw that IDLE writes POST
// when it posts next; with no part to come it says IDLE at once. It says
// IDLE once per sleep: a POST (or other signal) that came while it was
// awake, whose parts it took then, does not wake it again. Releases
// are held back up to half the window and written together, with the
// answer if any, before the worker's next item or as it goes to sleep:
// each message wakes the sender, which has the other half of the window
// to fill meanwhile. A CANCEL carries the count of parts posted before it,
// so that the receiver takes them first. A POST that finds the worker
// asleep and brings only parts that end their ops (a small transfer: one
// part) is handled by the connection's reader itself, which copies,
// answers and says IDLE as the worker would: handing the parts to the
// worker would cost a goroutine hand-off, and with it a thread's wake-up,
// per op (BenchmarkSendSmallCrossProcess: 102 µs per op against 110-129).
// An op of several parts that all came in one POST goes to the worker:
// the reader reads nothing while it copies, and would go on copying after
// a CANCEL or the connection's end, where the worker stops between parts.
//
// The window bounds what is in flight per connection (8 parts); a sender
// keeps at most 1024 ops open on one connection, and a receiver closes a
// connection that opens more than twice that.
//
// # Cancel and failure
//
// Send: when ctx ends, a Send whose first part was posted writes CANCEL
// and waits up to a second for the answer: ERR (the receiver stopped; the
// receipt fails with transport.ErrAborted) and Send returns the ctx error,
// or DONE (all copied already) and Send returns nil. If no answer comes, the
// connection is closed (failing the other ops on it). Before the CANCEL, a
// Send whose last part is posted and not yet released marks that part's
// ring entry as given up, and so does the sender, for every op still
// waiting for its answer, before it closes a connection; the receiver
// looks at the mark before it copies the last part and again just before
// it completes the receipt, and fails the receipt (ErrAborted) if it is
// set. So a receiver that takes the part only after its Send gave up (a
// process stalled past the second, which then reads the POST before the
// CANCEL) does not complete a receipt whose Send returned an error; only a
// receiver stalled for that second between its last look and the
// receipt's completion, a few instructions, still could. A Send that ends
// before its first part was posted writes ABORT for the tag (dialling for it
// if needed, within a second), which fails the receipt with
// transport.ErrAborted unless another Send is filling it. An ABORT that no
// connection took within that second (a receiver that stalled, a paused
// process that does not answer the dial's HELLO) is left to one goroutine
// per receiver, which redials and writes the ABORTs it holds once the
// receiver answers, for up to 30 seconds, and drops them when nothing
// listens at the endpoint any more, the receiver refuses the window, or
// the Transport closes; the receipt's owner ends a receipt whose ABORT
// never came at its own deadline. Close of the Transport cancels its Sends
// the same way (with no late ABORT).
//
// Recv.Cancel: the receipt ends with transport.ErrCanceled; a copy into it
// finishes its part (at most one slot) and Cancel returns once it has. The
// sender's Send fails with ErrRefused and transport.ErrCanceled (unless it
// had been answered DONE). A part for an unknown or ended tag is answered
// ERR and the connection stays up.
//
// A sender must announce its window right after the HELLOs, within the
// hello deadline; the window's descriptor must be a memfd sealed against
// writes on tmpfs (not hugetlbfs, whose pages a sender could release under
// the mapping). A descriptor that is not is closed without letting its
// sender make the close block its reader where it can (a socket's linger
// is cut to zero first; any other file, a FUSE file whose flush never
// answers, say, is closed on a goroutine of its own). A receiver takes one
// descriptor per connection, only with the bytes of a whole WINDOW, and a
// sender none: each read gives the kernel room for exactly that, so the
// kernel drops any other a peer sends without installing it (no close of
// ours runs; the connection ends with a protocol error). At most 16 closes
// run on goroutines of their own at a time in the process; beyond that a
// close runs on the reader of the peer's own connection, which stays open,
// counted against MaxConns, until the close returns. What a peer can leave
// blocked is so bounded by the connections it may hold; other senders'
// connections, new ones included, are not held up (unless it holds every
// one of MaxConns). A receiver's writes have a deadline, so a sender that stops reading
// cannot hold its worker; a CANCEL is taken once per op.
//
// # Idle connections
//
// The socket is any local process's to connect to, so with
// transport.Options.IdleTimeout (default 5 minutes; negative: none) a
// receiver closes an accepted connection that has made no progress for
// that long after its window: no message read, no part taken from the
// ring, nothing written to the sender (releases, answers, IDLE). Parts
// flow through the ring without a message while both sides are busy, so
// a silent socket alone is not idleness: the reader's deadline fires
// every IdleTimeout and the connection is kept if it moved since the
// last one, else closed; so a connection is closed between one and two
// IdleTimeouts after it last moved. That frees the place (MaxConns) and
// the mapping of a connection that said HELLO, announced its window and
// went silent, or stopped inside an op (its receipt fails with
// transport.ErrPeerLost) or inside a message. A connection that keeps
// sending messages, even ones that do nothing (a POST with no part), is
// kept, as tcp keeps one that carries frames for unknown tags.
//
// A sender retires its pooled connection to an endpoint once it has been
// unused for 3/4 of its own IdleTimeout (not handed to a Send or an
// abort, no op answered on it) with no op open: the next Send takes it
// out of the pool, ends it cleanly (the receiver reads the end between
// two messages) and dials anew. With one setting on both ends a receiver
// never closes a connection a sender is about to post a part in (the part
// would be lost with it, and the Send fail with transport.ErrPeerLost).
//
// A malformed message or ring entry, a part outside the window, a slot
// reused before its release, a ring count out of bounds, or too many open
// ops close that connection only (transport.ErrProtocol, logged). A
// connection that ends fails every receipt an op of it was filling with
// transport.ErrPeerLost (wrapping the protocol error, if any); a receipt
// that has seen no part is left to the caller's deadline. A sender sees a
// broken connection at once (its reader goroutine) and fails the Sends
// waiting on it with transport.ErrPeerLost; the next Send redials. A
// receipt completed at DONE stays complete: a Send whose connection breaks
// before it reads that DONE fails although every byte arrived.
//
// # Probe
//
// Probe dials the endpoint on a connection of its own, announces a window
// of one 4 KiB slot (and its ring) holding a random value and sends PROBE; the peer maps it and
// answers with the value it reads, which proves the same host and working
// shared mappings (PROBEOK), or with the reason it cannot (ERR).
package shm
