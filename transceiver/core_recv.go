package transceiver

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// recvCore is the receive side of one request on one generation rank: it
// asks every context rank in its target list (the driver dials and picks
// the backend; the core then writes the request-info), then receives from
// those that hold data for it once each says it is ready. It completes when
// every receive has finished, or fails (aborting the sources) at the first
// refusal, abort, error, lost connection, cancel or the deadline.
type recvCore struct {
	cfg      recvConfig
	deadline deadline
	phase    phase
	sources  []int            // context ranks, in target order
	srcs     map[int]*recvSrc // by context rank
	ready    map[int]bool
	pending  map[int]bool // receives started and not finished
}

// recvConfig is what a receive core knows of its request from the start.
type recvConfig struct {
	rank     int               // this generation rank
	id       uint64            // this rank's id of the transfer (wire GenRequestID)
	reqID    uint64            // the generation request's id, for messages
	sendID   uint64            // the context request's id
	token    [16]byte          // its transfer token
	sender   layout.CacheState // the context instance's state (from the opaque state)
	self     layout.CacheState // this instance's state, DP rank of the request included
	peers    int               // control endpoints the opaque state lists
	blocks   int               // blocks to receive into
	lastHash *kvcache.Hash     // ask for the blocks ending at this hash; nil: all of them
	digest   kvcache.Hash      // the prompt's digest (Request.PromptDigest), sent with the ask
	bufBytes int64             // size of one receive staging buffer
	direct   bool              // direct transfers allowed (zero_copy)
	timeout  time.Duration     // kv_transfer_timeout
	plans    *planMemo         // the layout results, once per peer state (nil: every time)
}

// recvSrc is one context rank the request pulls from.
type recvSrc struct {
	plan   *layout.Plan
	direct bool   // ask for a direct transfer (see directOK)
	conn   connID // the control connection, once dialled
}

// recvPlan is what a staged receive takes in: n blocks of plan's packed
// bytes, in chunks of chunk blocks through the staging buffers. (A direct
// receive is planned with its request-info: effRequestInfo.)
type recvPlan struct {
	plan  *layout.Plan
	n     int
	chunk int
}

func (p recvPlan) String() string {
	return fmt.Sprintf("blocks=%d bytes/block=%d chunk=%d", p.n, p.plan.PackedBytesPerBlock(), p.chunk)
}

// Events of the receive side.
type (
	// evDialled: the control connection to src is up and backend chosen.
	evDialled struct {
		src     int
		conn    connID
		backend string
	}
	// evAskFailed: the request-info could not reach src.
	evAskFailed struct {
		src int
		err error
	}
	// evReady: src (on conn) will send, in chunks of chunk blocks.
	evReady struct {
		conn  connID
		src   int
		chunk int
	}
	// evRefused: src (on conn) refused the request-info.
	evRefused struct {
		conn   connID
		src    int
		reason string
	}
	// evSrcAbort: src (on conn) aborted the transfer.
	evSrcAbort struct {
		conn   connID
		src    int
		reason string
	}
	// evReceived: the receive from src ended.
	evReceived struct {
		src int
		err error
	}
)

// Effects of the receive side.
type (
	// effAsk: reach src: dial its control endpoint (or reuse the
	// connection), choose the backend, then report evDialled.
	effAsk struct{ src int }
	// effRequestInfo: send ri to src; when direct, first arm a receipt
	// straight into the blocks and put its descriptor in ri, and once ri
	// is sent, start receiving into it (its end is evReceived): the data
	// of a direct transfer is its own announcement, so that the receive
	// does not wait for the source's Ready as well.
	effRequestInfo struct {
		src    int
		to     route
		ri     wire.RequestInfo
		plan   *layout.Plan
		direct bool
	}
	// effStartRecv: start receiving pair from src; chunk descriptors go
	// to to.
	effStartRecv struct {
		src  int
		to   route
		pair recvPlan
	}
)

func (evDialled) isEvent()   {}
func (evAskFailed) isEvent() {}
func (evReady) isEvent()     {}
func (evRefused) isEvent()   {}
func (evSrcAbort) isEvent()  {}
func (evReceived) isEvent()  {}

func (effAsk) isEffect()         {}
func (effRequestInfo) isEffect() {}
func (effStartRecv) isEffect()   {}

func (e effAsk) String() string { return fmt.Sprintf("ask src=%d", e.src) }
func (e effRequestInfo) String() string {
	s := fmt.Sprintf("request-info src=%d blocks=%d max-chunk=%d backend=%s", e.src, e.ri.NumBlocks, e.ri.MaxChunkBlocks, e.ri.Backend)
	if e.ri.HasLastHash {
		s += fmt.Sprintf(" last=%x", e.ri.LastHash[:4])
	}
	if e.direct {
		s += " direct"
	}
	return s
}
func (e effStartRecv) String() string { return fmt.Sprintf("start-recv src=%d %v", e.src, e.pair) }

// newRecvCore works out the sources of the request and the plan of each
// pair; an error here is the caller's (RequestAndReceiveAsync's) to return.
func newRecvCore(cfg recvConfig) (*recvCore, error) {
	sources, err := cfg.plans.targetRanks(cfg.sender, cfg.self, cfg.rank)
	if err != nil {
		return nil, fmt.Errorf("transceiver: rank %d: context ranks of request %d: %w", cfg.rank, cfg.sendID, err)
	}
	if cfg.blocks <= 0 {
		return nil, fmt.Errorf("transceiver: rank %d: request %d has no blocks to receive into", cfg.rank, cfg.reqID)
	}
	srcs := map[int]*recvSrc{}
	for _, c := range sources {
		if c >= cfg.peers {
			return nil, fmt.Errorf("%w: context rank %d has no endpoint", ErrBadOpaqueState, c)
		}
		plan, err := cfg.plans.plan(cfg.sender, c, cfg.self, cfg.rank)
		if err != nil {
			return nil, fmt.Errorf("transceiver: rank %d: plan from context rank %d: %w", cfg.rank, c, err)
		}
		srcs[c] = &recvSrc{plan: plan, direct: cfg.direct && plan.PackedBytesPerBlock() > 0 && directOK(plan, cfg.blocks)}
	}
	return &recvCore{cfg: cfg, sources: slices.Clone(sources), srcs: srcs, ready: map[int]bool{}, pending: map[int]bool{}}, nil
}

func (g *recvCore) state() phase { return g.phase }

func (g *recvCore) conns() []connID {
	var out []connID
	for _, c := range g.sources {
		if s := g.srcs[c]; s.conn != 0 {
			out = append(out, s.conn)
		}
	}
	return out
}

func (g *recvCore) step(ev event) []effect {
	switch ev := ev.(type) {
	case evStart:
		return g.start(ev.now)
	case evDialled:
		return g.dialled(ev)
	case evAskFailed:
		return g.fail(fmt.Errorf("ask context rank %d: %w", ev.src, ev.err), ev.src)
	case evReady:
		if !g.from(ev.conn, ev.src) {
			return nil
		}
		return g.readied(ev.src, ev.chunk)
	case evRefused:
		if !g.from(ev.conn, ev.src) {
			return nil
		}
		return g.fail(fmt.Errorf("%w by context rank %d: %s", ErrRefused, ev.src, ev.reason), ev.src)
	case evSrcAbort:
		if !g.from(ev.conn, ev.src) {
			return nil
		}
		return g.fail(fmt.Errorf("%w: context rank %d: %s", ErrPeerAborted, ev.src, ev.reason), ev.src)
	case evReceived:
		return g.received(ev.src, ev.err)
	case evConnLost:
		for _, c := range g.sources {
			if g.srcs[c].conn != ev.conn {
				continue
			}
			if g.ready[c] && g.phase == phaseMoving {
				// Its data is on the data plane, whose receive decides: a
				// context process that exits once its sends are done
				// closes this connection while the last bytes may still
				// be on their way, and a sender that is really gone fails
				// the receive there (or the deadline does).
				continue
			}
			return g.fail(ev.err, c)
		}
		return nil
	case evTick:
		return g.deadline.tick(ev.now, g.phase.over(), func(bool) []effect {
			return g.fail(fmt.Errorf("%w: request %d (context request %d) not received within %v", ErrTimeout, g.cfg.reqID, g.cfg.sendID, g.cfg.timeout), -1)
		})
	case evCancel:
		return g.fail(ev.err, -1)
	}
	panic(fmt.Sprintf("transceiver: receive core: unexpected event %T", ev))
}

// from reports whether a frame from src on conn belongs to this request:
// src is a source reached over conn.
func (g *recvCore) from(conn connID, src int) bool {
	s := g.srcs[src]
	return s != nil && conn != 0 && s.conn == conn
}

// start arms the deadline and asks every source.
func (g *recvCore) start(now time.Time) []effect {
	if len(g.sources) == 0 {
		g.phase = phaseFailed
		return []effect{effRelease{}, effComplete{err: fmt.Errorf("no context rank holds data for this rank")}}
	}
	effs := []effect{g.deadline.start(now, g.cfg.timeout)}
	for _, s := range g.sources {
		effs = append(effs, effAsk{src: s})
	}
	return effs
}

// dialled writes the request-info for src, now that its connection is up.
func (g *recvCore) dialled(ev evDialled) []effect {
	s := g.srcs[ev.src]
	if s == nil || g.phase.over() {
		return nil
	}
	s.conn = ev.conn
	st, err := g.cfg.plans.encode(g.cfg.self)
	if err != nil {
		return g.fail(fmt.Errorf("ask context rank %d: %w", ev.src, err), ev.src)
	}
	ri := wire.RequestInfo{CtxRequestID: g.cfg.sendID, Token: g.cfg.token, GenRequestID: g.cfg.id, GenRank: uint32(g.cfg.rank),
		GenState: st, NumBlocks: uint32(g.cfg.blocks), Backend: ev.backend, PromptDigest: g.cfg.digest}
	if g.cfg.lastHash != nil {
		ri.HasLastHash, ri.LastHash = true, *g.cfg.lastHash
	}
	if packed := s.plan.PackedBytesPerBlock(); packed > 0 {
		ri.MaxChunkBlocks = uint32(max(1, g.cfg.bufBytes/packed))
	}
	if s.direct {
		g.pending[ev.src] = true
	}
	return []effect{effRequestInfo{src: ev.src, to: g.route(ev.src), ri: ri, plan: s.plan, direct: s.direct}}
}

func (g *recvCore) route(src int) route {
	return route{conn: g.srcs[src].conn, sendID: g.cfg.sendID, recvID: g.cfg.id}
}

// readied handles a Ready from c: a source with data for this rank starts
// its receive, with the chunk size it announced checked against this
// rank's receive buffers. The receive of a direct transfer started with
// the request-info: its Ready only says that the data is on its way (and
// may come after the data).
func (g *recvCore) readied(c, chunk int) []effect {
	if g.phase.over() || g.ready[c] {
		return nil
	}
	g.ready[c] = true
	g.phase = phaseMoving
	s := g.srcs[c]
	var effs []effect
	if packed := s.plan.PackedBytesPerBlock(); packed > 0 && !s.direct {
		pair := recvPlan{plan: s.plan, n: g.cfg.blocks, chunk: chunk}
		if chunk <= 0 {
			return g.fail(fmt.Errorf("receive from context rank %d: %w: context rank %d announced chunks of %d blocks", c, wire.ErrMalformed, c, chunk), c)
		}
		if size := int64(min(chunk, g.cfg.blocks)) * packed; size > g.cfg.bufBytes {
			return g.fail(fmt.Errorf("receive from context rank %d: %w: chunk of %d bytes does not fit a %d-byte receive buffer", c, wire.ErrMalformed, size, g.cfg.bufBytes), c)
		}
		g.pending[c] = true
		effs = append(effs, effStartRecv{src: c, to: g.route(c), pair: pair})
	}
	return append(effs, g.maybeDone()...)
}

func (g *recvCore) maybeDone() []effect {
	if len(g.ready) == len(g.sources) && len(g.pending) == 0 {
		g.phase = phaseDone
		return []effect{effRelease{}, effComplete{}}
	}
	return nil
}

// received handles the end of the receive from c. Every byte of a direct
// transfer in place also says that c served this rank (its Ready may come
// later, or not before the request completes).
func (g *recvCore) received(c int, err error) []effect {
	if g.phase.over() || !g.pending[c] {
		return nil
	}
	delete(g.pending, c)
	if err != nil {
		return g.fail(fmt.Errorf("receive from context rank %d: %w", c, err), c)
	}
	g.ready[c] = true
	g.phase = phaseMoving
	return g.maybeDone()
}

// fail aborts every source but skip (whose failure this is), stops all
// receives, takes the blocks back and completes with err.
func (g *recvCore) fail(err error, skip int) []effect {
	if g.phase.over() {
		return nil
	}
	g.phase = phaseFailed
	var effs []effect
	for _, s := range g.sources {
		if s != skip {
			effs = append(effs, effAbort{side: sideRecv, peer: s, to: g.route(s), reason: err.Error()})
		}
	}
	return append(effs, effStopAll{}, effRelease{}, effComplete{err: err})
}
