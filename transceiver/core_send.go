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
// from it. The request completes when every send has finished, or fails
// (aborting the peers that asked) at the first error, an abort, a lost
// connection, a cancel or a deadline: kv_transfer_timeout from its start,
// and kv_transfer_sender_future_timeout, when set, from the start of its
// sends (the last ask).
//
// Who may ask is decided here too: a request-info must carry the request's
// token (compared in constant time; a wrong token gets the answer an unknown
// id gets, see refuseUnknown), a generation state compatible with this one,
// a generation rank this rank serves, a block range the request holds and a
// backend this rank has open.
type sendCore struct {
	cfg      sendConfig
	deadline deadline
	phase    phase
	expected []int             // generation ranks that will ask; nil until the first valid ask
	peers    map[int]*sendPeer // by generation rank: the asks accepted
	sending  map[int]bool      // sends started and not finished
}

// sendConfig is what a send core knows of its request from the start.
type sendConfig struct {
	rank     int               // this context rank
	id       uint64            // the context request's id
	token    [16]byte          // its transfer token
	state    layout.CacheState // the context instance's state, DP rank of the request included
	blocks   int               // blocks held
	hashes   []kvcache.Hash    // reuse hashes of the blocks, in order (may be fewer, or none)
	backends []string          // data backends open on this rank, sorted
	bufBytes int64             // size of one send staging buffer
	timeout  time.Duration     // kv_transfer_timeout
	// senderTimeout is kv_transfer_sender_future_timeout: how long the
	// sends may take once they start (once every generation rank asked);
	// 0: no bound of their own.
	senderTimeout time.Duration
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
	// waiting than the send can hold.
	evDescOverflow struct{ gen int }
	// evSent: the send to gen ended.
	evSent struct {
		gen int
		err error
	}
	// evGenAbort: the generation rank at from aborted the transfer.
	evGenAbort struct {
		from   route
		reason string
	}
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
	// effStartSend: start sending pair to gen.
	effStartSend struct {
		gen  int
		to   route
		pair sendPlan
	}
	// effChunk: hand the receipt of chunk index to the send to gen.
	effChunk struct {
		gen   int
		index int
		desc  transport.Descriptor
	}
)

func (evAsk) isEvent()          {}
func (evChunkDesc) isEvent()    {}
func (evDescOverflow) isEvent() {}
func (evSent) isEvent()         {}
func (evGenAbort) isEvent()     {}

func (effRefuse) isEffect()    {}
func (effReady) isEffect()     {}
func (effStartSend) isEffect() {}
func (effChunk) isEffect()     {}

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
func (e effReady) String() string     { return fmt.Sprintf("ready gen=%d chunk=%d", e.gen, e.chunk) }
func (e effStartSend) String() string { return fmt.Sprintf("start-send gen=%d %v", e.gen, e.pair) }
func (e effChunk) String() string     { return fmt.Sprintf("chunk gen=%d index=%d", e.gen, e.index) }

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
		if c.peers[ev.gen] == nil {
			return nil
		}
		return c.fail(fmt.Errorf("%w: generation rank %d: %s", ErrPeerAborted, ev.gen, "more chunk descriptors outstanding than any receiver may have"), ev.gen)
	case evSent:
		return c.sent(ev.gen, ev.err)
	case evGenAbort:
		if g, ok := c.peerAt(ev.from); ok {
			return c.fail(fmt.Errorf("%w: generation rank %d: %s", ErrPeerAborted, g, ev.reason), g)
		}
		return nil
	case evConnLost:
		for _, g := range c.expected {
			if p := c.peers[g]; p != nil && p.to.conn == ev.conn {
				return c.fail(ev.err, g)
			}
		}
		return nil
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
	refuse := func(code uint8, format string, args ...any) []effect {
		return []effect{effRefuse{gen: g, to: from, code: code, reason: fmt.Sprintf(format, args...)}}
	}
	expected, pair, code, reason := c.checkAsk(ri)
	if code != 0 {
		return refuse(code, "%s", reason)
	}
	if c.phase != phaseWaiting {
		return refuse(wire.RefusedBadRequest, "the transfer is already %s", c.phase)
	}
	if c.expected == nil {
		c.expected = slices.Clone(expected)
	} else if !slices.Equal(c.expected, expected) {
		return refuse(wire.RefusedBadRequest, "generation ranks of one request disagree on the generation layout")
	}
	if !slices.Contains(c.expected, g) { // (no plan pairs a non-target: checkAsk refuses it first)
		return refuse(wire.RefusedBadRequest, "generation rank %d is not a target of this context rank (targets %v)", g, c.expected)
	}
	if _, dup := c.peers[g]; dup {
		return refuse(wire.RefusedBadRequest, "generation rank %d asked twice", g)
	}
	c.peers[g] = &sendPeer{to: from, pair: pair}
	if len(c.peers) < len(c.expected) {
		return nil
	}
	// Everyone asked: serve them, in the order of the target list.
	c.phase = phaseMoving
	var effs []effect
	for _, g := range c.expected {
		p := c.peers[g]
		effs = append(effs, effReady{gen: g, to: p.to, chunk: p.pair.chunk})
	}
	for _, g := range c.expected {
		if p := c.peers[g]; p.pair.plan.PackedBytesPerBlock() > 0 {
			c.sending[g] = true
			effs = append(effs, effStartSend{gen: g, to: p.to, pair: p.pair})
		}
	}
	if len(c.sending) == 0 {
		c.phase = phaseDone
		return append(effs, effRelease{}, effComplete{})
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
	var gen layout.CacheState
	if err := gen.UnmarshalBinary(ri.GenState); err != nil {
		return bad(wire.RefusedBadRequest, "generation cache state: %v", err)
	}
	if err := layout.Compatible(c.cfg.state, gen); err != nil {
		return bad(wire.RefusedIncompatible, "%v", err)
	}
	g := int(ri.GenRank)
	if g >= gen.Parallel.NumRanks() {
		return bad(wire.RefusedBadRequest, "generation rank %d out of range for %d ranks", g, gen.Parallel.NumRanks())
	}
	expected, err := layout.TargetRanks(gen, c.cfg.state, c.cfg.rank)
	if err != nil {
		return bad(wire.RefusedIncompatible, "%v", err)
	}
	plan, err := layout.NewPlan(c.cfg.state, c.cfg.rank, gen, g)
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

// peerAt returns the generation rank whose ask came from from.
func (c *sendCore) peerAt(from route) (int, bool) {
	for g, p := range c.peers {
		if p.to.conn == from.conn && p.to.recvID == from.recvID {
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
		return c.fail(fmt.Errorf("send to generation rank %d: %w: chunk descriptor %d, expected %s", g, wire.ErrMalformed, ev.index, want), g)
	}
	p.next++
	return []effect{effChunk{gen: g, index: ev.index, desc: ev.desc}}
}

// sent handles the end of the send to g.
func (c *sendCore) sent(g int, err error) []effect {
	if c.phase != phaseMoving || !c.sending[g] {
		return nil // a late report after failure: nothing to do
	}
	delete(c.sending, g)
	if err != nil {
		return c.fail(fmt.Errorf("send to generation rank %d: %w", g, err), g)
	}
	if len(c.sending) == 0 {
		c.phase = phaseDone
		return []effect{effRelease{}, effComplete{}}
	}
	return nil
}

// fail ends the request with err: abort every generation rank that asked
// (but skip, the one whose failure this is, when >= 0), stop all sends,
// give the blocks back, complete with the error.
func (c *sendCore) fail(err error, skip int) []effect {
	if c.phase.over() {
		return nil
	}
	c.phase = phaseFailed
	var effs []effect
	for _, g := range c.expected {
		if p := c.peers[g]; p != nil && g != skip {
			effs = append(effs, effAbort{side: sideSend, peer: g, to: p.to, reason: err.Error()})
		}
	}
	return append(effs, effStopAll{}, effRelease{}, effComplete{err: err})
}
