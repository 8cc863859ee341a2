// Package transceiver moves a request's KV cache from the ranks of a context
// (prefill) instance to the ranks of a generation (decode) instance, with the
// API and request states of TensorRT-LLM's cache transceiver.
//
// It is the only package that knows both the public config and the
// transports: New reads config.CacheTransceiver and turns it into
// transport.Options, in one place.
//
// # Pure cores, one driver
//
// Each rank keeps, per request, a pure state machine for its side: the send
// core (core_send.go) on the context (prefill) instance, which holds the
// blocks and sends them, and the receive core (core_recv.go) on the
// generation instance, which pulls them into its own. A core takes typed
// events (a request-info, a Ready, a Refused, an Abort, a chunk descriptor,
// the end of a send or receive, a lost connection, a deadline tick, a
// cancel, the consensus' word on a pull attempt) and returns effects that
// say all there is to do: refuse with a wire code and a reason, answer
// Ready with the chunk size, start a send with its chunk plan, reach a
// context rank and write the request-info, start a receive, abort a peer,
// stop, tell the consensus how a pull attempt went, release the blocks,
// complete. The
// rules are the cores': who may ask (the request's token, compared in
// constant time; an unknown id and a wrong token get one answer), for
// what prompt (a context request with a prompt digest refuses a pull whose
// digest differs, so that one prompt's KV cache is never received, and
// published for reuse, as another's), what
// (compatible states, target ranks, block ranges and reused prefixes, open
// backends, direct transfers only where the spans allow), in what chunks.
// A core does no I/O, starts no goroutine and reads no clock; what it
// works out from a pair of cache states (the peer's state decoded, the
// compatibility, the target ranks, the copy plan) comes from a memo of
// those pure functions (plans.go), so that it is worked out once per peer
// state, not per request; the memo's lock is the only one a core takes.
//
// A third pure core, the consensus (consensus.go), is the instance's view
// of a request: it completes when every rank taking part has completed it,
// the first rank to fail cancels it on the others, the ranks' figures add
// up; and it decides the pull attempts of a context request (below). It
// names ranks, requests and attempts by number, never by pointer, so that
// it agrees across processes (below, "Ranks in several processes").
//
// # Failed pulls and retries
//
// A failed pull fails that generation request only. A pull is an attempt,
// named by the id its request-infos carry (wire GenRequestID: one id for
// every rank of the generation request, counting up from a random start per
// instance, or derived from the instance secret when the instance's ranks
// are in several processes, below). A context request stays pullable by its owner (whoever holds
// its opaque state, and so its token) until its deadline
// (kv_transfer_timeout), a cancel, a failure of the context side's own, or
// an attempt that completes on every rank. When an attempt fails for a
// reason of the generation side or the link (an abort from a generation
// rank, a lost control or data connection, a peer that breaks the
// protocol: peerCaused in errors.go), every context rank gives that attempt
// up, aborting its other peers and stopping its sends, and waits for the
// asks of another, keeping the blocks; the generation layout it expected is
// forgotten, since the retry may come from another generation instance. The
// owner pulls again with a new generation request and the same context
// phase params. The sender timeout (kv_transfer_sender_future_timeout)
// starts again with the sends of each attempt; kv_transfer_timeout does
// not. A rank whose sends of an attempt finished keeps the blocks until the
// consensus knows that every rank finished the same attempt, and only then
// releases them and completes; reports of an attempt that failed change
// nothing, and its late asks are aborted. An ask of a new attempt on a rank
// whose sends of another are under way or finished waits until that one is
// decided: a pull that succeeded is not served twice, even to its owner (a
// generation side may have all its bytes before the sends return). One on
// a rank still waiting for the other's asks gives that one up. After
// maxPullAttempts (3) failed attempts the request fails and releases its
// blocks, so that a failing or hostile owner cannot hold them in a loop. A
// failure of the context side's own (a local send error, a cancel, either
// deadline, the attempt bound) ends the request on every rank at once, as
// any failure of a receive does on the generation side. Once a context
// request is over, completed or not, every ask of it gets the answer an
// unknown id or a wrong token gets.
//
// A direct transfer (identical spans, zero_copy) takes one round trip of
// control frames: the generation rank arms a receipt straight into its
// blocks, sends its descriptor in the request-info and waits on the data
// plane from then on; the context rank sends the data at once and its
// Ready after it, so that no write holds the data up. The data is the
// receive's announcement; the Ready only tells a receiver whose control
// connection ends (a context process that exits once its sends are done)
// that the data went out, and that the data plane decides.
//
// One driver (rank.go) serves both sides: it feeds a request's core each
// event under the rank's lock and carries out the effects after, in one
// run; one cancel path, one close. It leaves the goroutine it runs on only
// for what may wait: a dial, on a goroutine of its own; a send or a
// receive, on one of the worker goroutines the rank keeps
// (internal/workers: up to 16 idle, ended by Close), so that a transfer
// starts no goroutine and grows no stack. A request-info on a connection already up is written on the
// goroutine that asked, and the end of a request (blocks back, the
// instance told) is carried out by the last of its goroutines to finish,
// not handed to another. Around it, internal/control keeps the
// control connections (accept loop, TLS, dial cache, the hello both
// directions send, handshake and idle timeouts, one reader per
// connection, answering pings), handing the driver every other frame and
// each lost connection and asking it whether a connection is busy;
// internal/link builds a rank's hello and reaches a context
// rank through them (the cached connection or a dial) and chooses the
// pair's backend (a pure function of both hellos, and of the probe of the
// peer's shm endpoint it may need); internal/mover is the data
// mover (one send or receive of a pair, direct or in chunks through the
// staging buffers), which mover.go hands each pair as the core planned it.
// The Transceiver feeds the consensus core what the ranks report and
// carries out its cancels.
//
// Time reaches the cores as events. A core asks for its deadline with an
// arm-timer effect (a request has one, the one armed last); the driver
// keeps the deadlines of a rank's requests, and its ask hold's, in a heap
// behind one timer (deadlines.go), armed for the earliest, and ticks each
// core whose deadline has come; a tick before the deadline arms it again.
// The send core has a second deadline,
// kv_transfer_sender_future_timeout from the start of its sends, and asks
// for the tick of whichever comes first. The control connections'
// handshake and idle timeouts are read deadlines. The tests of every
// deadline run under testing/synctest, whose fake clock time.Now, timers
// and deadlines follow inside a bubble: the instances there listen, dial
// and move data on an in-memory network (network.go: the machine's unless
// a test injects one), since a goroutine waiting on a real socket would
// keep the fake clock from moving.
//
// # Ranks in several processes
//
// A Transceiver hosts the ranks Options.Ranks of its instance (all of them
// by default). Engines that run one process per GPU rank give each process
// its ranks and an Options.Group, through which the processes agree:
// every process keeps a copy of the consensus core and applies the same
// totally ordered log of the ranks' reports (a process's begin of a
// request, a rank's end, a pull attempt's end, a start that failed, a
// cancel, the loss of a process's ranks), carrying out the effects for its
// own ranks and completing its own Requests. A CoordinatedGroup orders the
// log at the process hosting rank 0, over TCP connections of its own
// (mutual TLS and a join authenticated by the cluster secret when they are
// configured); a GatherGroup orders it by the rounds of an all-gather the
// caller runs with its own communicator (Outbox, Deliver; Run for Go
// callers), each round's contributions applied in process order. The log's
// messages (groupwire.go) are versioned, bounded and fuzzed.
//
// The processes join once: each contributes its ranks, their control
// endpoints and 32 random bytes. Every process then knows every rank's
// endpoint (each hands out opaque states listing them all) and the
// instance secret (SHA-256 of the contributions). The caller's request ids
// are the same in every process (as TensorRT-LLM's replicated scheduler
// has them); from the instance secret every process derives the same
// transfer token of a context request (HMAC of its id and prompt length)
// and the same pull id of a generation request (HMAC of its id and the
// opaque state), with no message per request. The token of one request
// does not give another's, nor that of the same id in another instance;
// the ids of an instance's context requests must not repeat within its
// life, since a repeated id has the same token. A generation request
// retried in a split instance takes a new id.
//
// Each process calls RespondAndSendAsync for a request at its own time,
// and any process's opaque state may be handed on as soon as it has it, so
// a generation rank's ask may reach a context rank before that rank holds
// the request. A fourth pure core, the rank's ask hold (core_hold.go),
// decides what becomes of it: the rank holds the ask when the consensus, as
// this process has applied the log, shows the request begun on the
// instance, not failed or committed and not reported by this rank (the log
// is the instance's, so a stranger cannot make it say so; any other ask
// gets the unknown answer at once, as in a process that hosts every rank);
// when the rank is handed the request the asks go to its send core in the
// order they came, and the token and every other check happen there. A
// held ask is refused when kv_transfer_timeout from the request's begin
// (or from the ask, if earlier) passes, saying so, or when the request
// ends on the instance first (a cancel reaching the rank), and dropped when
// its asker goes; a rank holds at most 64 asks a control connection and
// 1,024 in all, and gives the excess the unknown answer at once. An ask
// that comes before this process has applied the begin at all is refused
// as unknown: the log usually travels faster than the opaque state, which
// goes through a router. With every rank in one process, asks are never
// held (no ask can come before the state is handed out). The driver keeps
// the hold among the rank's requests, so that it is fed, ticked, told of
// lost connections and cancelled at close as they are.
//
// A process whose link breaks (its connection to the coordinator, a round
// of the all-gather, which the caller then reports with Fail) has left: its
// ranks count as failed in every process, which cancels the requests they
// took part in at once (a coordinated group's connections are probed when
// idle, so that a process whose host died or was cut off without closing
// them is found out within about 5 s). A process that loses the group
// fails what it has in flight with ErrGroupLost and refuses new requests.
// Stats.Agreement is what the consensus cost a request: from its last
// rank's end to its completion in this process.
//
// What a group does not do: find out a process that is frozen on a live
// host (it answers the probes; a write to it times out after
// CoordinatedConfig.WriteTimeout, when there is traffic); serve a process
// that joins late or again (the group is formed once, in New or the first
// round; a process that left does not come back).
//
// # Scripts
//
// The cores are tested by scripts under testdata/ (send, recv, consensus,
// hold): events in, effects out, rewritten by go test -run Scripts
// -update, so that a change of the protocol is reviewed as a diff of the
// scripts. From
// testdata/send/serve.script:
//
//	new-sender
//	start
//	----
//	arm-timer at=+10s
//
//	ask gen=1 tp=2
//	----
//	(none)
//
//	ask gen=1 tp=2
//	----
//	refuse gen=1 code=bad-request: generation rank 1 asked twice
//
//	ask gen=0 tp=2
//	----
//	ready gen=0 chunk=4
//	ready gen=1 chunk=4
//	start-send gen=0 blocks=0+4 bytes/block=2048 backend=tcp chunk=4
//	start-send gen=1 blocks=0+4 bytes/block=2048 backend=tcp chunk=4
//
// A context rank of a TP1 instance holds a request of 4 blocks; handed over,
// it arms the deadline kv_transfer_timeout (10 s) away. Generation rank 1
// of a TP2 instance asks: its request-info passes the checks, and its
// layout tells the core that ranks 0 and 1 will ask, so it waits. Rank 1
// asking again is refused with the wire code bad-request. Once rank 0 has
// asked too, each gets a Ready with the chunk size, then a send starts to
// each with its plan: blocks 0 to 3, half the heads of each (2 KiB a block
// packed), over tcp, in chunks of 4 blocks (all that the receiver takes and
// a 64 KiB staging buffer holds). When both sends have reported their end,
// the core tells the consensus (attempt-sent) and holds the blocks; once
// the consensus says that every rank has finished the same attempt
// (commit), it says release-blocks and complete ok, and the driver gives
// the blocks back once no send touches them and reports to the consensus.
//
// # Signed opaque states and allowed peers
//
// The opaque state a context instance hands out (request id, transfer
// token, CacheState, the control endpoint of each rank) travels through the
// client-facing router, so it is untrusted input to the generation instance
// that receives it. With a cluster secret (Options.Secret) the context side
// signs it: version 2 of the encoding adds an expiry (the moment the context
// side releases the blocks anyway: issue time + kv_transfer_timeout_ms), a
// random 128-bit nonce and an HMAC-SHA256 over every byte before it, under a
// key derived from the secret with HKDF. The generation side, before it
// dials anything, refuses a state that is unsigned (ErrUnsignedOpaqueState),
// whose MAC does not match (ErrForgedOpaqueState, compared in constant
// time), that has expired (ErrExpiredOpaqueState) or whose nonce it has
// already accepted (ErrReplayedOpaqueState). Accepted nonces are kept until
// their expiry, but for the nonce of a pull that failed without a refusal
// from the context side, or of a request refused before its pull began,
// which is given back so that the owner may pull again (the context
// instance still holds the request, or refuses the state), at most Options.NonceCacheSize of them; when that many are
// unexpired, new states are refused (ErrReplayCacheFull) rather than old
// nonces forgotten. Expiry compares the generation host's clock with the
// context host's: a clock skew between them shortens or stretches the
// window by as much, so keep the clocks of a cluster in sync.
//
// Dial targets are checked too (ErrPeerNotAllowed): loopback always; with an
// allow-list (Options.AllowedPeerHosts) the hosts on it; without a secret
// nothing else (the instance logs once, as a warning, that it is
// unauthenticated); with a secret and no allow-list any host, since the
// signature vouches for the endpoints. With an allow-list, the control
// listener serves connections from loopback and the listed hosts only.
//
// Every listener binds Options.ListenHost (the data backends get it as
// transport.Options.ListenAddr; Listeners reports them all). Inbound
// connections are bounded before and after their handshake (ConnLimits):
// a total and a per-host cap on each rank's control connections (the
// excess is closed at once, logged at most once a second per reason), a
// handshake timeout, and an idle timeout after which a control connection
// with no request in flight is closed; the dialling side closes its own a
// little earlier and redials when it next needs one. An Observer that is
// also a ConnObserver counts them.
package transceiver
