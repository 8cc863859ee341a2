package transceiver

import (
	"fmt"
	"slices"
	"strings"
)

// The pure core of the transfer protocol: one state machine per request per
// rank and side. It performs no I/O, starts no goroutines and reads no
// clock: the driver (rank.go) feeds it events (a generation rank asked, a
// send finished, the deadline passed) and carries out the effects it returns
// (send a Ready, start a send, abort the peers, complete the request).
// Script-driven tests (core_test.go) run it without any network.

// phase is where a core stands.
type phase uint8

const (
	phaseWaiting phase = iota // context: waiting for the generation ranks to ask; generation: asking
	phaseMoving               // data is moving
	phaseDone                 // every byte moved
	phaseFailed               // ended with an error
)

func (p phase) String() string {
	return [...]string{"waiting", "moving", "done", "failed"}[p]
}

// effectKind says what the driver must do.
type effectKind uint8

const (
	effRefuse    effectKind = iota + 1 // context: refuse peer's ask (Reason)
	effReady                           // context: tell Peer it will be served
	effStartSend                       // context: start sending to Peer
	effAsk                             // generation: send the request-info to Peer
	effStartRecv                       // generation: start receiving from Peer
	effAbort                           // tell Peer the transfer failed (Reason)
	effStopAll                         // stop every send or receive of this request
	effComplete                        // the request is over on this rank: Err nil or not
)

// effect is one instruction from the core to the driver.
type effect struct {
	kind   effectKind
	peer   int    // peer rank, where it applies
	reason string // effRefuse, effAbort
	err    error  // effComplete
}

func (e effect) String() string {
	name := [...]string{"", "refuse", "ready", "start-send", "ask", "start-recv", "abort", "stop-all", "complete"}[e.kind]
	switch e.kind {
	case effRefuse, effAbort:
		return fmt.Sprintf("%s(%d: %s)", name, e.peer, e.reason)
	case effStopAll:
		return name
	case effComplete:
		if e.err != nil {
			return fmt.Sprintf("%s(error: %v)", name, e.err)
		}
		return name + "(ok)"
	}
	return fmt.Sprintf("%s(%d)", name, e.peer)
}

func effectsString(effs []effect) string {
	s := make([]string, len(effs))
	for i, e := range effs {
		s[i] = e.String()
	}
	return strings.Join(s, " ")
}

// ctxCore is the context side of one request on one rank. The context rank
// learns which generation ranks will ask from the first request-info (it
// carries the generation CacheState); it waits until every one of them has
// asked, then tells each it is ready and sends to those that need data from
// it. The request completes when every send has finished.
type ctxCore struct {
	phase    phase
	expected []int        // generation ranks that will ask; nil until the first ask
	asked    map[int]bool // gen rank → it needs data from this rank
	sending  map[int]bool // sends not yet finished
	err      error
}

func newCtxCore() *ctxCore {
	return &ctxCore{asked: map[int]bool{}, sending: map[int]bool{}}
}

// ask handles a request-info from generation rank g. expected is the list of
// generation ranks that will ask (TargetRanks from this rank's view), and
// hasData whether g needs bytes from this rank (a non-empty plan).
func (c *ctxCore) ask(g int, expected []int, hasData bool) []effect {
	if c.phase != phaseWaiting {
		return []effect{{kind: effRefuse, peer: g, reason: fmt.Sprintf("the transfer is already %s", c.phase)}}
	}
	if c.expected == nil {
		c.expected = slices.Clone(expected)
	} else if !slices.Equal(c.expected, expected) {
		return []effect{{kind: effRefuse, peer: g, reason: "generation ranks of one request disagree on the generation layout"}}
	}
	if !slices.Contains(c.expected, g) {
		return []effect{{kind: effRefuse, peer: g, reason: fmt.Sprintf("generation rank %d is not a target of this context rank (targets %v)", g, c.expected)}}
	}
	if _, dup := c.asked[g]; dup {
		return []effect{{kind: effRefuse, peer: g, reason: fmt.Sprintf("generation rank %d asked twice", g)}}
	}
	c.asked[g] = hasData
	if len(c.asked) < len(c.expected) {
		return nil
	}
	// Everyone asked: serve them, in the order of the target list.
	c.phase = phaseMoving
	var effs []effect
	for _, p := range c.expected {
		effs = append(effs, effect{kind: effReady, peer: p})
	}
	for _, p := range c.expected {
		if c.asked[p] {
			c.sending[p] = true
			effs = append(effs, effect{kind: effStartSend, peer: p})
		}
	}
	if len(c.sending) == 0 {
		c.phase = phaseDone
		effs = append(effs, effect{kind: effComplete})
	}
	return effs
}

// sent handles the end of the send to g.
func (c *ctxCore) sent(g int, err error) []effect {
	if c.phase != phaseMoving || !c.sending[g] {
		return nil // a late report after failure: nothing to do
	}
	delete(c.sending, g)
	if err != nil {
		return c.fail(fmt.Errorf("send to generation rank %d: %w", g, err), g)
	}
	if len(c.sending) == 0 {
		c.phase = phaseDone
		return []effect{{kind: effComplete}}
	}
	return nil
}

// fail ends the request with err: abort every generation rank that asked
// (except skip, the one whose failure this is, when >= 0), stop all sends,
// complete with the error.
func (c *ctxCore) fail(err error, skip int) []effect {
	if c.phase == phaseDone || c.phase == phaseFailed {
		return nil
	}
	c.phase, c.err = phaseFailed, err
	var effs []effect
	for _, p := range c.expectedOrAsked() {
		if _, ok := c.asked[p]; ok && p != skip {
			effs = append(effs, effect{kind: effAbort, peer: p, reason: err.Error()})
		}
	}
	return append(effs, effect{kind: effStopAll}, effect{kind: effComplete, err: err})
}

func (c *ctxCore) expectedOrAsked() []int {
	if c.expected != nil {
		return c.expected
	}
	return nil
}

// peerAbort handles an abort from generation rank g.
func (c *ctxCore) peerAbort(g int, reason string) []effect {
	return c.fail(fmt.Errorf("%w: generation rank %d: %s", ErrPeerAborted, g, reason), g)
}

// timeout handles the deadline: nobody (or not everybody) came in time, or
// the sends took too long.
func (c *ctxCore) timeout(err error) []effect { return c.fail(err, -1) }

// cancel handles a local cancel. It reports whether there was anything to
// cancel.
func (c *ctxCore) cancel(err error) ([]effect, bool) {
	if c.phase == phaseDone || c.phase == phaseFailed {
		return nil, false
	}
	return c.fail(err, -1), true
}

// genCore is the generation side of one request on one rank: it asks every
// context rank in its target list, then receives from those that hold data
// for it once each says it is ready. It completes when every receive has
// finished.
type genCore struct {
	phase   phase
	sources []int        // context ranks, in target order
	hasData map[int]bool // ctx rank → it sends data to this rank
	ready   map[int]bool
	pending map[int]bool // receives started and not finished
	err     error
}

func newGenCore(sources []int, hasData map[int]bool) *genCore {
	return &genCore{sources: slices.Clone(sources), hasData: hasData, ready: map[int]bool{}, pending: map[int]bool{}}
}

// start asks every source.
func (g *genCore) start() []effect {
	effs := make([]effect, 0, len(g.sources))
	for _, s := range g.sources {
		effs = append(effs, effect{kind: effAsk, peer: s})
	}
	if len(g.sources) == 0 {
		g.phase = phaseFailed
		g.err = fmt.Errorf("no context rank holds data for this rank")
		return []effect{{kind: effComplete, err: g.err}}
	}
	return effs
}

// readied handles a Ready from context rank c.
func (g *genCore) readied(c int) []effect {
	if g.phase == phaseDone || g.phase == phaseFailed || !slices.Contains(g.sources, c) || g.ready[c] {
		return nil
	}
	g.ready[c] = true
	g.phase = phaseMoving
	var effs []effect
	if g.hasData[c] {
		g.pending[c] = true
		effs = append(effs, effect{kind: effStartRecv, peer: c})
	}
	return append(effs, g.maybeDone()...)
}

func (g *genCore) maybeDone() []effect {
	if len(g.ready) == len(g.sources) && len(g.pending) == 0 {
		g.phase = phaseDone
		return []effect{{kind: effComplete}}
	}
	return nil
}

// received handles the end of the receive from c.
func (g *genCore) received(c int, err error) []effect {
	if g.phase != phaseMoving || !g.pending[c] {
		return nil
	}
	delete(g.pending, c)
	if err != nil {
		return g.fail(fmt.Errorf("receive from context rank %d: %w", c, err), c)
	}
	return g.maybeDone()
}

// refused handles a Refused from c.
func (g *genCore) refused(c int, reason string) []effect {
	return g.fail(fmt.Errorf("%w by context rank %d: %s", ErrRefused, c, reason), c)
}

// peerAbort handles an Abort from c.
func (g *genCore) peerAbort(c int, reason string) []effect {
	return g.fail(fmt.Errorf("%w: context rank %d: %s", ErrPeerAborted, c, reason), c)
}

func (g *genCore) timeout(err error) []effect { return g.fail(err, -1) }

func (g *genCore) cancel(err error) ([]effect, bool) {
	if g.phase == phaseDone || g.phase == phaseFailed {
		return nil, false
	}
	return g.fail(err, -1), true
}

// fail aborts every source but skip (whose failure this is) that was asked
// and has not finished, stops all receives and completes with err.
func (g *genCore) fail(err error, skip int) []effect {
	if g.phase == phaseDone || g.phase == phaseFailed {
		return nil
	}
	g.phase, g.err = phaseFailed, err
	var effs []effect
	for _, s := range g.sources {
		if s != skip {
			effs = append(effs, effect{kind: effAbort, peer: s, reason: err.Error()})
		}
	}
	return append(effs, effect{kind: effStopAll}, effect{kind: effComplete, err: err})
}
