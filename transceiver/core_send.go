package transceiver

import (
	"crypto/subtle"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// sendCore is the send side of one request on one context rank. The rank
// learns which generation ranks will ask from the first valid request-info
// (it carries the generation CacheState); it waits until every one of them
// has asked, then tells each it is ready and sends to those that need data
// from it.
//
// A pull is an attempt, named by the id its asks carry (wire GenRequestID:
// one id for every rank of the generation request; see
// Transceiver.RequestAndReceiveAsync). When this rank's sends of an attempt
// have finished it reports so to the instance (effAttemptEnded) and holds
// the blocks (phaseSent) until the instance says that every rank finished
// the same attempt (evCommit): then it releases them and completes. A
// failure of the generation side or the link (an abort, a lost connection,
// a send error that is the peer's, a peer breaking the protocol: see
// peerCaused) fails the attempt, not the request: the rank aborts the
// attempt's other peers, stops its sends, reports the failure and waits for
// the asks of a new attempt, blocks held, expected generation ranks
// forgotten (a new attempt may come from another generation instance). The
// instance abandons the attempt on every rank (evAttemptFailed). A rank in
// phaseSent reports a failure but keeps waiting for the instance's word. An
// ask of another attempt abandons the current one (the owner has given it
// up), or waits for the instance's word in phaseSent. A late report of an
// abandoned attempt changes nothing, and its late asks are aborted.
//
// The request fails (aborting the peers that asked, releasing the blocks)
// at a failure of the context side's own (a local send error), a cancel,
// the deadline kv_transfer_timeout from its start, the sender timeout
// kv_transfer_sender_future_timeout, when set, from the start of an
// attempt's sends (the last ask), or once maxPullAttempts attempts have
// failed.
//
// Who may ask is decided here too: a request-info must carry the request's
// token (compared in constant time; a wrong token gets the answer an unknown
// id gets, see refuseUnknown), a generation state compatible with this one,
// a generation rank this rank serves, a block range the request holds and a
// backend this rank has open.
type sendCore struct {
	cfg       sendConfig
	deadline  deadline
	phase     phase
	attempt   uint64            // the current attempt (its asks' GenRequestID); 0: no ask accepted yet
	attemptAt time.Time         // when the current attempt's first ask was accepted
	failed    []uint64          // the attempts that failed, in order
	doubted   bool              // phaseSent: a failure of the attempt is reported already
	deferred  []deferredAsk     // phaseSent: asks of another attempt, until the instance's word
	expected  []int             // generation ranks that will ask; nil until the first valid ask of the attempt
	peers     map[int]*sendPeer // by generation rank: the asks of the attempt accepted
	sending   map[int]bool      // sends of the attempt started and not finished
}

// maxPullAttempts bounds the pull attempts of a context request: when this
// many have failed, the request fails and its blocks go back, so that an
// owner that keeps failing (or a hostile one) cannot hold them in a loop
// until the deadline.
const maxPullAttempts = 3

// maxDeferredAsks bounds the asks of a new attempt a rank keeps while it
// waits for the instance's word on the attempt before (phaseSent); more are
// refused.
const maxDeferredAsks = 64

// deferredAsk is an ask kept for later.
type deferredAsk struct {
	from route
	ri   *wire.RequestInfo
}

// forget drops the deferred asks drop says to (their asker is gone).
func (c *sendCore) forget(drop func(deferredAsk) bool) {
	c.deferred = slices.DeleteFunc(c.deferred, drop)
}

// sendConfig is what a send core knows of its request from the start.
type sendConfig struct {
	rank     int               // this context rank
	id       uint64            // the context request's id
	token    [16]byte          // its transfer token
	state    layout.CacheState // the context instance's state, DP rank of the request included
	blocks   int               // blocks held
	hashes   []kvcache.Hash    // reuse hashes of the blocks, in order (may be fewer, or none)
	digest   kvcache.Hash      // the prompt's digest (Request.PromptDigest); zero: not checked
	backends []string          // data backends open on this rank, sorted
	bufBytes int64             // size of one send staging buffer
	timeout  time.Duration     // kv_transfer_timeout
	// senderTimeout is kv_transfer_sender_future_timeout: how long the
	// sends may take once they start (once every generation rank asked);
	// 0: no bound of their own.
	senderTimeout time.Duration
	// plans works out the checks' layout results once per peer state
	// (nil: every time).
	plans *planMemo
}

// sendPeer is a generation rank whose ask was accepted.
type sendPeer struct {
	to   route
	pair sendPlan
	next int // index of the next chunk descriptor expected
}

// sendPlan is what one send moves: blocks [first, first+n) of the request,
// packed by plan, over backend; straight into the receiver's blocks (direct
// non-nil: the receipt it armed) or in chunks of chunk blocks through the
// staging buffers, each to a receipt the receiver announces with a chunk
// descriptor.
type sendPlan struct {
	plan     *layout.Plan
	first, n int
	chunk    int
	backend  string
	direct   transport.Descriptor
}

// chunks is the number of staged chunks (0 for a direct send or when
// nothing moves).
func (p sendPlan) chunks() int {
	if p.direct != nil || p.chunk <= 0 {
		return 0
	}
	return (p.n + p.chunk - 1) / p.chunk
}

func (p sendPlan) String() string {
	s := fmt.Sprintf("blocks=%d+%d bytes/block=%d backend=%s", p.first, p.n, p.plan.PackedBytesPerBlock(), p.backend)
	if p.direct != nil {
		return s + " direct"
	}
	return s + fmt.Sprintf(" chunk=%d", p.chunk)
}

// Events of the send side.
type (
	// evAsk: a request-info arrived at now (decoded, not yet checked).
	evAsk struct {
		from route
		ri   *wire.RequestInfo
		now  time.Time
	}
	// evChunkDesc: the receiver announced the receipt of chunk index.
	evChunkDesc struct {
		from  route
		index int
		desc  transport.Descriptor
	}
	// evDescOverflow: generation rank gen has more chunk descriptors
	// waiting than the send of attempt can hold.
	evDescOverflow struct {
		gen     int
		attempt uint64
	}
	// evSent: the send to gen of attempt ended.
	evSent struct {
		gen     int
		attempt uint64
		err     error
	}
	// evGenAbort: the generation rank at from aborted the transfer.
	evGenAbort struct {
		from   route
		reason string
	}
	// evAttemptFailed: the instance says that pull attempt failed (on
	// this rank or another) with err: every rank abandons it.
	evAttemptFailed struct {
		attempt uint64
		err     error
		now     time.Time
	}
	// evCommit: the instance says that every rank finished the sends of
	// pull attempt: the request is done.
	evCommit struct{ attempt uint64 }
)

// Effects of the send side.
type (
	// effRefuse: answer a request-info with Refused (code, reason). note,
	// when set, is for the log only: the peer gets the same answer either
	// way.
	effRefuse struct {
		gen    int
		to     route
		code   uint8
		reason string
		note   string
	}
	// effReady: tell gen it will be served, in chunks of chunk blocks.
	effReady struct {
		gen   int
		to    route
		chunk int
	}
	// effStartSend: start sending pair to gen, for attempt. readyAfter:
	// tell gen Ready (chunks of pair.chunk blocks) once every byte is
	// sent, not before: a direct transfer's receiver waits on its data
	// and needs the Ready only to know, should this rank's control
	// connection end, that the data went out; written first, it would
	// hold up the data by a write.
	effStartSend struct {
		gen        int
		to         route
		pair       sendPlan
		attempt    uint64
		readyAfter bool
	}
	// effChunk: hand the receipt of chunk index to the send to gen of
	// attempt.
	effChunk struct {
		gen     int
		index   int
		desc    transport.Descriptor
		attempt uint64
	}
	// effStopAttempt: stop the sends of attempt (and any that starts
	// later); the blocks stay held.
	effStopAttempt struct{ attempt uint64 }
	// effAttemptEnded: tell the instance that this rank's sends of
	// attempt finished (err nil), or that the attempt failed (err).
	effAttemptEnded struct {
		attempt uint64
		err     error
	}
)

func (evAsk) isEvent()           {}
func (evChunkDesc) isEvent()     {}
func (evDescOverflow) isEvent()  {}
func (evSent) isEvent()          {}
func (evGenAbort) isEvent()      {}
func (evAttemptFailed) isEvent() {}
func (evCommit) isEvent()        {}

func (effRefuse) isEffect()       {}
func (effReady) isEffect()        {}
func (effStartSend) isEffect()    {}
func (effChunk) isEffect()        {}
func (effStopAttempt) isEffect()  {}
func (effAttemptEnded) isEffect() {}

var refusalCodes = map[uint8]string{
	wire.RefusedUnknown: "unknown", wire.RefusedIncompatible: "incompatible", wire.RefusedBadRequest: "bad-request",
	wire.RefusedVersion: "version", wire.RefusedUnavailable: "unavailable",
}

func (e effRefuse) String() string {
	s := fmt.Sprintf("refuse gen=%d code=%s: %s", e.gen, refusalCodes[e.code], e.reason)
	if e.note != "" {
		s += " (log: " + e.note + ")"
	}
	return s
}
func (e effRefuse) dest() route { return e.to }
func (e effRefuse) frame() wire.Frame {
	return &wire.Refused{CtxRequestID: e.to.sendID, GenRequestID: e.to.recvID, Code: e.code, Reason: e.reason}
}
func (e effReady) dest() route { return e.to }
func (e effReady) frame() wire.Frame {
	return &wire.Ready{CtxRequestID: e.to.sendID, GenRequestID: e.to.recvID, ChunkBlocks: uint32(e.chunk)}
}

func (e effReady) String() string { return fmt.Sprintf("ready gen=%d chunk=%d", e.gen, e.chunk) }
func (e effStartSend) String() string {
	s := fmt.Sprintf("start-send gen=%d %v", e.gen, e.pair)
	if e.readyAfter {
		s += fmt.Sprintf(", then ready chunk=%d", e.pair.chunk)
	}
	return s
}
func (e effChunk) String() string { return fmt.Sprintf("chunk gen=%d index=%d", e.gen, e.index) }
func (e effStopAttempt) String() string {
	return fmt.Sprintf("stop-sends attempt=%d", e.attempt)
}
func (e effAttemptEnded) String() string {
	if e.err != nil {
		return fmt.Sprintf("attempt-failed attempt=%d: %v", e.attempt, e.err)
	}
	return fmt.Sprintf("attempt-sent attempt=%d", e.attempt)
}

func newSendCore(cfg sendConfig) *sendCore {
	return &sendCore{cfg: cfg, peers: map[int]*sendPeer{}, sending: map[int]bool{}}
}

func (c *sendCore) state() phase { return c.phase }

func (c *sendCore) conns() []connID {
	var out []connID
	for _, g := range c.expected {
		if p := c.peers[g]; p != nil {
			out = append(out, p.to.conn)
		}
	}
	for _, d := range c.deferred {
		out = append(out, d.from.conn)
	}
	return out
}

// refuseUnknown is the answer to a request-info for a request this rank
// does not hold. A wrong token gets the same answer, so that the answer
// does not tell a stranger which ids exist.
func refuseUnknown(rank int, from route, ri *wire.RequestInfo, note string) effect {
	return effRefuse{gen: int(ri.GenRank), to: from, code: wire.RefusedUnknown, note: note,
		reason: fmt.Sprintf("context request %d is not held by context rank %d (unknown id or wrong token, expired, cancelled or already transferred)", ri.CtxRequestID, rank)}
}

func (c *sendCore) step(ev event) []effect {
	switch ev := ev.(type) {
	case evStart:
		return []effect{c.deadline.start(ev.now, c.cfg.timeout)}
	case evAsk:
		return c.ask(ev.from, ev.ri, ev.now)
	case evChunkDesc:
		return c.chunkDesc(ev)
	case evDescOverflow:
		if c.peers[ev.gen] == nil || ev.attempt != c.attempt {
			return nil
		}
		return c.abandon(fmt.Errorf("%w: generation rank %d: %s", ErrPeerAborted, ev.gen, "more chunk descriptors outstanding than any receiver may have"), ev.gen)
	case evSent:
		return c.sent(ev.gen, ev.attempt, ev.err)
	case evGenAbort:
		if g, ok := c.peerAt(ev.from); ok {
			return c.abandon(fmt.Errorf("%w: generation rank %d: %s", ErrPeerAborted, g, ev.reason), g)
		}
		c.forget(func(d deferredAsk) bool { return d.from.conn == ev.from.conn && d.from.recvID == ev.from.recvID })
		return nil
	case evConnLost:
		c.forget(func(d deferredAsk) bool { return d.from.conn == ev.conn })
		for _, g := range c.expected {
			if p := c.peers[g]; p != nil && p.to.conn == ev.conn {
				return c.abandon(ev.err, g)
			}
		}
		return nil
	case evAttemptFailed:
		return c.attemptFailed(ev.attempt, ev.err, ev.now)
	case evCommit:
		return c.commit(ev.attempt)
	case evTick:
		return c.deadline.tick(ev.now, c.phase.over(), func(second bool) []effect {
			if second {
				return c.fail(fmt.Errorf("%w: context request %d: sends to generation ranks %v not finished within kv_transfer_sender_future_timeout_ms=%d of their asks",
					ErrTimeout, c.cfg.id, slices.Sorted(maps.Keys(c.sending)), c.cfg.senderTimeout.Milliseconds()), -1)
			}
			return c.fail(fmt.Errorf("%w: context request %d not pulled and sent within %v", ErrTimeout, c.cfg.id, c.cfg.timeout), -1)
		})
	case evCancel:
		return c.fail(ev.err, -1)
	}
	panic(fmt.Sprintf("transceiver: send core: unexpected event %T", ev))
}

// ask handles a request-info that arrived at now.
func (c *sendCore) ask(from route, ri *wire.RequestInfo, now time.Time) []effect {
	if subtle.ConstantTimeCompare(c.cfg.token[:], ri.Token[:]) != 1 {
		return []effect{refuseUnknown(c.cfg.rank, from, ri, "wrong transfer token")}
	}
	g := int(ri.GenRank)
	refuse := func(effs []effect, code uint8, format string, args ...any) []effect {
		return append(effs, effRefuse{gen: g, to: from, code: code, reason: fmt.Sprintf(format, args...)})
	}
	expected, pair, code, reason := c.checkAsk(ri)
	if code != 0 {
		return refuse(nil, code, "%s", reason)
	}
	if c.phase.over() {
		return refuse(nil, wire.RefusedBadRequest, "the transfer is already %s", c.phase)
	}
	effs, take := c.attemptOf(from, ri, refuse)
	if !take {
		return effs
	}
	if c.phase != phaseWaiting {
		return refuse(effs, wire.RefusedBadRequest, "the transfer is already %s", c.phase)
	}
	if c.expected == nil {
		c.expected = slices.Clone(expected)
	} else if !slices.Equal(c.expected, expected) {
		return refuse(effs, wire.RefusedBadRequest, "generation ranks of one request disagree on the generation layout")
	}
	if !slices.Contains(c.expected, g) { // (no plan pairs a non-target: checkAsk refuses it first)
		return refuse(effs, wire.RefusedBadRequest, "generation rank %d is not a target of this context rank (targets %v)", g, c.expected)
	}
	if _, dup := c.peers[g]; dup {
		return refuse(effs, wire.RefusedBadRequest, "generation rank %d asked twice", g)
	}
	c.peers[g] = &sendPeer{to: from, pair: pair}
	if c.attempt != ri.GenRequestID {
		c.attempt, c.attemptAt = ri.GenRequestID, now
	}
	if len(c.peers) < len(c.expected) {
		return effs
	}
	return append(effs, c.serve(now)...)
}

// attemptOf places ask ri, of pull attempt ri.GenRequestID, against the
// attempt this rank knows: it reports the ask's answer, or take, with the
// effects of giving up an attempt the ask supersedes, when the ask goes on
// to be taken. refuse appends a refusal of the ask to effs.
func (c *sendCore) attemptOf(from route, ri *wire.RequestInfo, refuse func(effs []effect, code uint8, format string, args ...any) []effect) (effs []effect, take bool) {
	g, a := int(ri.GenRank), ri.GenRequestID
	switch {
	case a == 0:
		return refuse(nil, wire.RefusedBadRequest, "a request-info without a generation request id"), false
	case slices.Contains(c.failed, a):
		// A late ask of an attempt that failed (on another rank, or
		// before this generation rank asked): an abort, as its peers of
		// the attempt got, not a refusal: the request is still held.
		return []effect{effAbort{side: sideSend, peer: g, to: from,
			reason: fmt.Sprintf("pull attempt %d of context request %d has failed; the request is held for another", a, c.cfg.id)}}, false
	case c.attempt != 0 && a != c.attempt && (c.phase == phaseMoving || c.phase == phaseSent):
		// Another attempt is under way, or has finished here and waits
		// for the instance's word. The ask waits until that attempt is
		// decided: if it holds, the request is over and the ask gets the
		// unknown answer (a pull that succeeded is not served twice, even
		// to its owner); if it fails (its generation side's abort or lost
		// connection, a deadline), the ask is taken then. A new ask never
		// gives a live attempt up: a generation side that completed its
		// receive may ask again before this rank's sends have returned.
		if len(c.deferred) >= maxDeferredAsks {
			return refuse(nil, wire.RefusedUnavailable, "too many asks waiting on context rank %d", c.cfg.rank), false
		}
		c.deferred = append(c.deferred, deferredAsk{from: from, ri: ri})
		return nil, false
	case c.attempt != 0 && a != c.attempt:
		// An attempt whose asks have not all come, nothing sent yet: the
		// owner has given it up for a new one.
		effs = c.abandon(fmt.Errorf("%w: generation rank %d: pull attempt %d superseded by pull attempt %d", ErrPeerAborted, g, c.attempt, a), -1)
		if c.phase.over() {
			return append(effs, refuseUnknown(c.cfg.rank, from, ri, "")), false
		}
	}
	return effs, true
}

// serve starts serving every generation rank once all have asked, in the
// order of the target list: the Ready of each staged send, then the sends
// (no send for a peer that gets no bytes), and the second deadline.
func (c *sendCore) serve(now time.Time) []effect {
	c.phase = phaseMoving
	var effs []effect
	for _, g := range c.expected {
		if p := c.peers[g]; p.pair.direct == nil {
			effs = append(effs, effReady{gen: g, to: p.to, chunk: p.pair.chunk})
		}
	}
	for _, g := range c.expected {
		if p := c.peers[g]; p.pair.plan.PackedBytesPerBlock() > 0 {
			c.sending[g] = true
			effs = append(effs, effStartSend{gen: g, to: p.to, pair: p.pair, attempt: c.attempt, readyAfter: p.pair.direct != nil})
		}
	}
	if len(c.sending) == 0 {
		return append(effs, c.sentAll()...)
	}
	if c.cfg.senderTimeout > 0 {
		effs = append(effs, c.deadline.startSecond(now, c.cfg.senderTimeout)...)
	}
	return effs
}

// checkAsk checks what a request-info asks for against the request, and
// works out the send: the generation ranks this rank serves, and the plan of
// the pair. A refusal comes back as its wire code (non-zero) and reason.
func (c *sendCore) checkAsk(ri *wire.RequestInfo) (expected []int, pair sendPlan, code uint8, reason string) {
	bad := func(code uint8, format string, args ...any) ([]int, sendPlan, uint8, string) {
		return nil, sendPlan{}, code, fmt.Sprintf(format, args...)
	}
	if c.cfg.digest != (kvcache.Hash{}) && kvcache.Hash(ri.PromptDigest) != c.cfg.digest {
		return bad(wire.RefusedBadRequest, "the pulling request's prompt is not context request %d's (its prompt digest differs or is missing): the KV cache would be another prompt's", c.cfg.id)
	}
	gen, err := c.cfg.plans.state(ri.GenState)
	if err != nil {
		return bad(wire.RefusedBadRequest, "generation cache state: %v", err)
	}
	if err := c.cfg.plans.compatible(c.cfg.state, gen); err != nil {
		return bad(wire.RefusedIncompatible, "%v", err)
	}
	g := int(ri.GenRank)
	if g >= gen.Parallel.NumRanks() {
		return bad(wire.RefusedBadRequest, "generation rank %d out of range for %d ranks", g, gen.Parallel.NumRanks())
	}
	expected, err = c.cfg.plans.targetRanks(gen, c.cfg.state, c.cfg.rank)
	if err != nil {
		return bad(wire.RefusedIncompatible, "%v", err)
	}
	plan, err := c.cfg.plans.plan(c.cfg.state, c.cfg.rank, gen, g)
	if err != nil {
		return bad(wire.RefusedIncompatible, "%v", err)
	}
	n := int(ri.NumBlocks)
	first := c.cfg.blocks - n
	if ri.HasLastHash {
		end := slices.IndexFunc(c.cfg.hashes, func(h kvcache.Hash) bool { return h == kvcache.Hash(ri.LastHash) })
		if end < 0 {
			return bad(wire.RefusedBadRequest, "no block of context request %d has the requested last-block hash", c.cfg.id)
		}
		first = end + 1 - n
	}
	if n <= 0 || first < 0 || first+n > c.cfg.blocks {
		return bad(wire.RefusedBadRequest, "asked for %d blocks, context request %d has %d", n, c.cfg.id, c.cfg.blocks)
	}
	if !slices.Contains(c.cfg.backends, ri.Backend) {
		return bad(wire.RefusedUnavailable, "backend %q is not open on context rank %d (open: %v)", ri.Backend, c.cfg.rank, c.cfg.backends)
	}
	pair = sendPlan{plan: plan, first: first, n: n, backend: ri.Backend}
	packed := plan.PackedBytesPerBlock()
	switch {
	case packed == 0:
	case len(ri.Desc) > 0:
		if !directOK(plan, n) {
			return bad(wire.RefusedBadRequest, "a direct transfer was asked for a plan whose spans are too small for one")
		}
		pair.direct, pair.chunk = ri.Desc, n
	default:
		pair.chunk = chunkBlocks(int64(ri.MaxChunkBlocks), c.cfg.bufBytes, packed, n)
	}
	return expected, pair, 0, ""
}

// chunkBlocks sizes the chunks of a staged send of n blocks of packed bytes
// each: as many blocks as the receiver takes (maxChunk) and one send buffer
// holds, at least one.
func chunkBlocks(maxChunk, bufBytes, packed int64, n int) int {
	return int(max(1, min(maxChunk, bufBytes/packed, int64(n))))
}

// peerAt returns the generation rank of the attempt whose ask came from
// from.
func (c *sendCore) peerAt(from route) (int, bool) {
	for _, g := range c.expected {
		if p := c.peers[g]; p != nil && p.to.conn == from.conn && p.to.recvID == from.recvID {
			return g, true
		}
	}
	return 0, false
}

// chunkDesc handles the receipt of a chunk: in order, one per chunk of a
// staged send.
func (c *sendCore) chunkDesc(ev evChunkDesc) []effect {
	g, ok := c.peerAt(ev.from)
	if !ok || c.phase.over() {
		return nil
	}
	p := c.peers[g]
	if n := p.pair.chunks(); ev.index != p.next || p.next >= n {
		want := fmt.Sprint(p.next)
		if p.next >= n {
			want = "none"
		}
		return c.abandon(fmt.Errorf("send to generation rank %d: %w: chunk descriptor %d, expected %s", g, wire.ErrMalformed, ev.index, want), g)
	}
	p.next++
	return []effect{effChunk{gen: g, index: ev.index, desc: ev.desc, attempt: c.attempt}}
}

// sent handles the end of the send to g of attempt a.
func (c *sendCore) sent(g int, a uint64, err error) []effect {
	if c.phase != phaseMoving || a != c.attempt || !c.sending[g] {
		return nil // a late report, of an attempt given up or a request over: nothing to do
	}
	delete(c.sending, g)
	if err != nil {
		err = fmt.Errorf("send to generation rank %d: %w", g, err)
		if peerCaused(err) {
			return c.abandon(err, g)
		}
		return c.fail(err, g)
	}
	if len(c.sending) == 0 {
		return c.sentAll()
	}
	return nil
}

// sentAll: every send of the attempt has finished. The rank tells the
// instance and holds the blocks until its word (evCommit, or
// evAttemptFailed when another rank's part failed).
func (c *sendCore) sentAll() []effect {
	c.phase = phaseSent
	c.deadline.second = time.Time{} // the sender timeout is the attempt's sends'
	return []effect{effAttemptEnded{attempt: c.attempt}}
}

// abandon fails the current attempt for err, a failure of the generation
// side or the link, the fault of generation rank skip (-1: none in
// particular). While the attempt's sends are under way this rank leaves it
// at once (see leave), reports the failure, and counts it. Once they have
// finished (phaseSent) it has reported the attempt finished: it reports the
// failure, once, and waits for the instance's word, blocks held.
func (c *sendCore) abandon(err error, skip int) []effect {
	if c.phase.over() || c.attempt == 0 {
		return nil
	}
	a := c.attempt
	if c.phase == phaseSent {
		if c.doubted {
			return nil
		}
		c.doubted = true
		return []effect{effAttemptEnded{attempt: a, err: err}}
	}
	effs := append(c.leave(err, skip), effAttemptEnded{attempt: a, err: err})
	return append(effs, c.count(a, err, time.Time{})...)
}

// attemptFailed handles the instance's word that attempt a failed with
// err: the rank leaves it if it is the current one, and counts it.
func (c *sendCore) attemptFailed(a uint64, err error, now time.Time) []effect {
	if c.phase.over() || a == 0 || slices.Contains(c.failed, a) {
		return nil
	}
	var effs []effect
	if a == c.attempt {
		effs = c.leave(err, -1)
	}
	return append(effs, c.count(a, err, now)...)
}

// leave gives the current attempt up: its peers (but skip) are told, its
// sends stopped, and the rank waits for the asks of the next attempt, with
// the blocks and the request's deadline, the expected generation ranks
// forgotten.
func (c *sendCore) leave(err error, skip int) []effect {
	var effs []effect
	for _, g := range c.expected {
		if p := c.peers[g]; p != nil && g != skip {
			effs = append(effs, effAbort{side: sideSend, peer: g, to: p.to, reason: err.Error()})
		}
	}
	if c.phase == phaseMoving {
		effs = append(effs, effStopAttempt{attempt: c.attempt})
	}
	c.phase, c.attempt, c.doubted, c.expected = phaseWaiting, 0, false, nil
	c.peers, c.sending = map[int]*sendPeer{}, map[int]bool{}
	c.deadline.second = time.Time{} // (its timer, if armed, ticks early and is armed again for the deadline)
	return effs
}

// count records that attempt a failed with err. The maxPullAttempts-th
// failure fails the request; before, the asks that waited for the
// instance's word are taken now (at now; zero: when they came).
func (c *sendCore) count(a uint64, err error, now time.Time) []effect {
	c.failed = append(c.failed, a)
	if len(c.failed) >= maxPullAttempts {
		return c.fail(fmt.Errorf("%w: context request %d: %d pull attempts failed, the last with: %w", ErrTooManyAttempts, c.cfg.id, len(c.failed), err), -1)
	}
	asks := c.deferred
	c.deferred = nil
	var effs []effect
	for _, d := range asks {
		effs = append(effs, c.ask(d.from, d.ri, now)...)
	}
	return effs
}

// commit handles the instance's word that every rank finished the sends
// of attempt a: the request is done.
func (c *sendCore) commit(a uint64) []effect {
	if c.phase != phaseSent || a != c.attempt {
		return nil
	}
	c.phase = phaseDone
	return append(c.refuseDeferred(), effRelease{}, effComplete{})
}

// refuseDeferred answers the asks that waited for the instance's word:
// the request is no longer held.
func (c *sendCore) refuseDeferred() []effect {
	var effs []effect
	for _, d := range c.deferred {
		effs = append(effs, refuseUnknown(c.cfg.rank, d.from, d.ri, ""))
	}
	c.deferred = nil
	return effs
}

// fail ends the request with err: abort every generation rank of the
// attempt that asked (but skip, the one whose failure this is, when >= 0),
// stop all sends, give the blocks back, complete with the error.
func (c *sendCore) fail(err error, skip int) []effect {
	if c.phase.over() {
		return nil
	}
	c.phase = phaseFailed
	effs := c.refuseDeferred()
	for _, g := range c.expected {
		if p := c.peers[g]; p != nil && g != skip {
			effs = append(effs, effAbort{side: sideSend, peer: g, to: p.to, reason: err.Error()})
		}
	}
	return append(effs, effStopAll{}, effRelease{}, effComplete{err: err})
}
