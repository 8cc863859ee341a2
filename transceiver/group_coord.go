package transceiver

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// CoordinatedConfig configures a CoordinatedGroup.
type CoordinatedConfig struct {
	// Processes is the number of processes of the instance (at least 1).
	Processes int
	// Coordinator is the host:port on which the process hosting rank 0
	// listens and which the other processes dial.
	Coordinator string
	// Listener, on the process hosting rank 0, is used instead of
	// listening on Coordinator (a port the system chose); the group closes
	// it. Nil: listen on Coordinator.
	Listener net.Listener
	// Secret, when set (nil: the Transceiver's Options.Secret), authenticates
	// the join: each join and the coordinator's answer carry an
	// HMAC-SHA256 under a key derived from it, so that a process without
	// the secret can neither join nor pose as the coordinator.
	Secret []byte
	// TLS, when set (nil: the Transceiver's Options.TLS), makes the
	// group's connections mutual TLS (both configs required), as
	// Options.TLS does for the control connections.
	TLS *transport.TLSConfig
	// WriteTimeout bounds each write to a connection; 0 means 10 s. A
	// process that does not read for that long is taken for dead.
	WriteTimeout time.Duration
}

// CoordinatedGroup is a Group over TCP connections of kvxfer's own: the
// process hosting rank 0 coordinates, the others dial it (Coordinator).
// The coordinator sequences the instance's log: every process sends it the
// events of its ranks; it appends them, in the order they arrive, to the
// log, and sends every piece of the log to every process, applying it
// itself too. A process whose connection breaks has left: the coordinator
// logs the loss of its ranks, which fails its requests on every process at
// once. A process that loses the coordinator fails its requests in flight
// with ErrGroupLost and refuses new ones.
//
// New joins the group: on the coordinator it waits (within New's ctx) for
// every other process to dial in; elsewhere it dials the coordinator until
// it answers or ctx ends.
type CoordinatedGroup struct {
	cfg CoordinatedConfig

	mu      sync.Mutex
	m       groupMember
	coord   bool
	self    int // this process's index
	ln      net.Listener
	conns   []net.Conn    // coordinator: by process (nil: self, or lost); others: [0] the coordinator
	ranksOf [][]int       // ranks of each process
	failed  error         // this process has left or lost the group
	unacked [][]instEvent // non-coordinator: sent, not yet seen back in the log
	closed  bool
	net     network // from the Transceiver (inherit): where a process dials the coordinator; nil: TCP

	queue evQueue // coordinator: what to sequence; others: what to send
	echo  localEcho
	wg    sync.WaitGroup
}

// NewCoordinatedGroup checks cfg and returns the group; it starts nothing.
func NewCoordinatedGroup(cfg CoordinatedConfig) (*CoordinatedGroup, error) {
	if cfg.Processes < 1 || cfg.Processes > maxGroupProcs {
		return nil, fmt.Errorf("%w: coordinated group of %d processes (1..%d)", ErrBadGroup, cfg.Processes, maxGroupProcs)
	}
	if cfg.Coordinator == "" && cfg.Listener == nil {
		return nil, fmt.Errorf("%w: coordinated group: no coordinator address", ErrBadGroup)
	}
	if cfg.TLS != nil && (cfg.TLS.Server == nil || cfg.TLS.Client == nil) {
		return nil, fmt.Errorf("%w: coordinated group: TLS needs both a Server and a Client config", ErrBadGroup)
	}
	if cfg.WriteTimeout <= 0 {
		cfg.WriteTimeout = 10 * time.Second
	}
	return &CoordinatedGroup{cfg: cfg}, nil
}

// Coordinator returns the address the coordinator listens on (once
// started, the listener's), for the other processes to dial.
func (g *CoordinatedGroup) Coordinator() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ln != nil {
		return g.ln.Addr().String()
	}
	if g.cfg.Listener != nil {
		return g.cfg.Listener.Addr().String()
	}
	return g.cfg.Coordinator
}

func (g *CoordinatedGroup) joinKey() []byte {
	if len(g.cfg.Secret) == 0 {
		return nil
	}
	m := hmac.New(sha256.New, g.cfg.Secret)
	m.Write([]byte("kvxfer/v1/group-join"))
	return m.Sum(nil)
}

// writeJoinFrame writes msg, with its MAC under the join key when there is
// one.
func (g *CoordinatedGroup) writeJoinFrame(c net.Conn, msg []byte) error {
	if k := g.joinKey(); k != nil {
		m := hmac.New(sha256.New, k)
		m.Write(msg)
		msg = m.Sum(msg)
	}
	c.SetWriteDeadline(time.Now().Add(g.cfg.WriteTimeout))
	return writeGroupFrame(c, msg)
}

// readJoinFrame reads a join-phase message, checking its MAC.
func (g *CoordinatedGroup) readJoinFrame(r *bufio.Reader) (*groupMsg, error) {
	k := g.joinKey()
	if k == nil {
		return readGroupFrame(r)
	}
	raw, err := readRawGroupFrame(r)
	if err != nil {
		return nil, err
	}
	if len(raw) < sha256.Size+2 {
		return nil, fmt.Errorf("%w: join of %d bytes has no MAC", ErrBadGroupMessage, len(raw))
	}
	body, mac := raw[:len(raw)-sha256.Size], raw[len(raw)-sha256.Size:]
	m := hmac.New(sha256.New, k)
	m.Write(body)
	if !hmac.Equal(m.Sum(nil), mac) {
		return nil, fmt.Errorf("%w: the join's MAC does not match (another cluster secret?)", ErrBadGroup)
	}
	return decodeGroupMsg(body)
}

func (g *CoordinatedGroup) start(ctx context.Context, m groupMember, self groupJoin) error {
	g.mu.Lock()
	if g.m != nil {
		g.mu.Unlock()
		return fmt.Errorf("%w: coordinated group already serves a transceiver", ErrBadGroup)
	}
	g.m = m
	g.coord = slices.Contains(self.ranks, 0)
	g.mu.Unlock()
	if g.coord {
		return g.startCoordinator(ctx, m, self)
	}
	return g.startMember(ctx, m, self)
}

// startCoordinator listens, takes the join of every other process, orders
// the processes by their lowest rank (the coordinator first), answers
// every process with all the joins, and starts sequencing.
func (g *CoordinatedGroup) startCoordinator(ctx context.Context, m groupMember, self groupJoin) error {
	ln := g.cfg.Listener
	if ln == nil {
		var lc net.ListenConfig
		var err error
		if ln, err = lc.Listen(ctx, "tcp", g.cfg.Coordinator); err != nil {
			return fmt.Errorf("transceiver: coordinated group: listen on %s: %w", g.cfg.Coordinator, err)
		}
	}
	if g.cfg.TLS != nil {
		ln = tls.NewListener(ln, g.cfg.TLS.Server)
	}
	g.mu.Lock()
	g.ln = ln
	g.mu.Unlock()
	others, err := g.acceptJoins(ctx, ln)
	if err != nil {
		return err
	}
	fail := func(err error) error {
		for _, j := range others {
			j.c.Close()
		}
		return err
	}
	slices.SortFunc(others, func(a, b joiner) int { return slices.Min(a.join.ranks) - slices.Min(b.join.ranks) })
	joins := []groupJoin{self}
	for _, j := range others {
		joins = append(joins, j.join)
	}
	if err := m.joined(joins); err != nil {
		return fail(err)
	}
	msg := encodeJoined(joins)
	g.mu.Lock()
	g.conns = make([]net.Conn, len(joins))
	g.ranksOf = make([][]int, len(joins))
	for p, j := range joins {
		g.ranksOf[p] = j.ranks
	}
	for i, j := range others {
		g.conns[i+1] = j.c
	}
	g.mu.Unlock()
	for _, j := range others {
		if err := g.writeJoinFrame(j.c, msg); err != nil {
			return fail(fmt.Errorf("transceiver: coordinated group: answer the join: %w", err))
		}
	}
	for i, j := range others {
		g.wg.Add(1)
		go g.readFrom(i+1, j.c, j.r)
	}
	g.wg.Add(1)
	go g.sequence(m)
	return nil
}

// joiner is a process that joined the coordinator: its connection, the
// reader of it, and what it said of itself.
type joiner struct {
	c    net.Conn
	r    *bufio.Reader
	join groupJoin
}

// acceptJoins accepts the join of every other process of the group on ln,
// dropping connections whose first message is no valid join, until all
// have joined or ctx ends. Either way it closes ln (no one else is to
// connect); on failure it closes the connections of those that joined.
//
// Joins are read concurrently, each within WriteTimeout, so that a
// connection that says nothing (a stranger, a port scan) does not keep the
// processes behind it waiting; at most maxPendingJoins of them are read at
// once, and those beyond are closed at once.
func (g *CoordinatedGroup) acceptJoins(ctx context.Context, ln net.Listener) ([]joiner, error) {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	h := &joinHandshakes{g: g, joined: make(chan joiner), failed: make(chan error, 1), done: make(chan struct{}), conns: map[net.Conn]bool{}}
	h.wg.Go(func() { h.accept(ln) })
	var others []joiner
	var err error
	for err == nil && len(others) < g.cfg.Processes-1 {
		select {
		case j := <-h.joined:
			others = append(others, j)
		case err = <-h.failed:
			if ctx.Err() != nil {
				err = context.Cause(ctx)
			}
		}
	}
	ln.Close()
	h.stop()
	if err != nil {
		for _, j := range others {
			j.c.Close()
		}
		return nil, fmt.Errorf("transceiver: coordinated group: %d of %d processes joined: %w", len(others)+1, g.cfg.Processes, err)
	}
	return others, nil
}

// maxPendingJoins bounds the connections whose join the coordinator reads
// at once.
const maxPendingJoins = 64

// joinHandshakes reads the joins of the connections the coordinator
// accepts, each on a goroutine of its own, owned by acceptJoins (stop).
type joinHandshakes struct {
	g      *CoordinatedGroup
	joined chan joiner
	failed chan error    // the accept loop's end
	done   chan struct{} // closed by stop
	wg     sync.WaitGroup

	mu      sync.Mutex
	conns   map[net.Conn]bool // being read
	stopped bool              // stop has closed them
}

// accept accepts connections until ln is closed, and starts reading the
// join of each, up to maxPendingJoins at a time.
func (h *joinHandshakes) accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			h.failed <- err
			return
		}
		h.mu.Lock()
		refuse := h.stopped || len(h.conns) >= maxPendingJoins
		if !refuse {
			h.conns[c] = true
		}
		h.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		h.wg.Go(func() { h.read(c) })
	}
}

// read reads the join of c within WriteTimeout and hands it over; a
// connection whose first message is not a valid join is closed.
func (h *joinHandshakes) read(c net.Conn) {
	keepAlive(c)
	c.SetReadDeadline(time.Now().Add(h.g.cfg.WriteTimeout))
	r := bufio.NewReader(c)
	msg, err := h.g.readJoinFrame(r)
	if err == nil && msg.typ != groupMsgJoin {
		err = fmt.Errorf("%w: first message of type %d, want a join", ErrBadGroupMessage, msg.typ)
	}
	h.mu.Lock()
	delete(h.conns, c)
	h.mu.Unlock()
	if err != nil { // not a process of this instance: refused
		c.Close()
		return
	}
	c.SetReadDeadline(time.Time{})
	select {
	case h.joined <- joiner{c, r, msg.join}:
	case <-h.done:
		c.Close()
	}
}

// stop ends the reads in progress (their connections are closed) and
// waits for every goroutine; the listener must be closed first.
func (h *joinHandshakes) stop() {
	close(h.done)
	h.mu.Lock()
	h.stopped = true
	for c := range h.conns {
		c.Close()
	}
	h.mu.Unlock()
	h.wg.Wait()
}

// readFrom reads the batches of process p and queues them for the log; when
// its connection breaks, it queues the loss of its ranks.
func (g *CoordinatedGroup) readFrom(p int, c net.Conn, r *bufio.Reader) {
	defer g.wg.Done()
	for {
		msg, err := readGroupFrame(r)
		if err == nil && msg.typ != groupMsgBatch {
			err = fmt.Errorf("%w: message of type %d after the join", ErrBadGroupMessage, msg.typ)
		}
		if err != nil {
			c.Close()
			g.mu.Lock()
			closed := g.closed
			ranks := g.ranksOf[p]
			g.mu.Unlock()
			if !closed {
				g.queue.push(p, []instEvent{ranksLostEvent{ranks: ranks,
					err: fmt.Errorf("%w: process %d (ranks %s) left: %v", ErrGroupLost, p, intsString(ranks), err), now: time.Now()}})
			}
			return
		}
		g.queue.push(p, msg.events)
	}
}

// sequence is the coordinator's log: it takes what the processes send, in
// the order it arrives, sends each piece to every process and applies it.
func (g *CoordinatedGroup) sequence(m groupMember) {
	defer g.wg.Done()
	for {
		p, evs, ok := g.queue.pop()
		if !ok {
			return
		}
		g.mu.Lock()
		conns := slices.Clone(g.conns)
		g.mu.Unlock()
		for rest := evs; len(rest) > 0; {
			b, n := encodeSome(p, rest)
			rest = rest[n:]
			for q, c := range conns {
				if c == nil {
					continue
				}
				c.SetWriteDeadline(time.Now().Add(g.cfg.WriteTimeout))
				if err := writeGroupFrame(c, b); err != nil {
					// Its reader sees the close and logs the loss.
					c.Close()
					conns[q] = nil
					g.mu.Lock()
					g.conns[q] = nil
					g.mu.Unlock()
				}
			}
		}
		for _, ev := range evs {
			if lost, ok := ev.(ranksLostEvent); ok {
				g.mu.Lock()
				for q, rs := range g.ranksOf {
					if slices.Equal(rs, lost.ranks) && g.conns[q] != nil {
						g.conns[q].Close()
						g.conns[q] = nil
					}
				}
				g.mu.Unlock()
			}
		}
		m.apply(evs)
	}
}

// startMember dials the coordinator until it answers or ctx ends, joins,
// and starts the reader and the writer.
func (g *CoordinatedGroup) startMember(ctx context.Context, m groupMember, self groupJoin) error {
	addr := g.cfg.Coordinator
	if g.cfg.Listener != nil {
		addr = g.cfg.Listener.Addr().String()
	}
	var c net.Conn
	var r *bufio.Reader
	var msg *groupMsg
	var last error
	retry := time.NewTimer(0)
	defer retry.Stop()
	<-retry.C
	for wait := 10 * time.Millisecond; ; wait = min(wait*2, 200*time.Millisecond) {
		var err error
		if c, err = g.dial(ctx, addr); err == nil {
			if err = g.writeJoinFrame(c, encodeJoin(self)); err == nil {
				// The coordinator answers once every process has joined.
				stop := context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Now()) })
				r = bufio.NewReader(c)
				msg, err = g.readJoinFrame(r)
				stop()
				if err == nil && msg.typ != groupMsgJoined {
					err = fmt.Errorf("%w: the coordinator answered with type %d", ErrBadGroupMessage, msg.typ)
				}
				if err == nil {
					break
				}
			}
			c.Close()
			if ctx.Err() == nil && errors.Is(err, ErrBadGroup) {
				return fmt.Errorf("transceiver: coordinated group: join %s: %w", addr, err)
			}
		}
		last = err
		retry.Reset(wait)
		select {
		case <-ctx.Done():
			return fmt.Errorf("transceiver: coordinated group: join the coordinator at %s: %w (last: %v)", addr, context.Cause(ctx), last)
		case <-retry.C:
		}
	}
	self0 := slices.Min(self.ranks)
	idx := slices.IndexFunc(msg.joins, func(j groupJoin) bool { return len(j.ranks) > 0 && slices.Min(j.ranks) == self0 })
	if idx < 0 {
		c.Close()
		return fmt.Errorf("%w: the coordinator's answer does not list this process (ranks %s)", ErrBadGroup, intsString(self.ranks))
	}
	// Before joined: the Transceiver publishes as soon as it has joined.
	g.mu.Lock()
	g.self, g.conns = idx, []net.Conn{c}
	g.mu.Unlock()
	if err := m.joined(msg.joins); err != nil {
		c.Close()
		return err
	}
	g.wg.Add(2)
	go g.readLog(m, c, r)
	go g.writeLog(m, c)
	return nil
}

func (g *CoordinatedGroup) dial(ctx context.Context, addr string) (net.Conn, error) {
	g.mu.Lock()
	nw := g.net
	g.mu.Unlock()
	var c net.Conn
	var err error
	if nw != nil {
		dctx, cancel := context.WithTimeout(ctx, g.cfg.WriteTimeout)
		c, err = nw.Dial(dctx, addr)
		cancel()
	} else {
		d := net.Dialer{Timeout: g.cfg.WriteTimeout, KeepAliveConfig: groupKeepAlive}
		c, err = d.DialContext(ctx, "tcp", addr)
	}
	if err != nil || g.cfg.TLS == nil {
		return c, err
	}
	cfg := g.cfg.TLS.Client.Clone()
	if cfg.ServerName == "" {
		cfg.ServerName, _, _ = net.SplitHostPort(addr)
	}
	tc := tls.Client(c, cfg)
	hctx, cancel := context.WithTimeout(ctx, g.cfg.WriteTimeout)
	defer cancel()
	if err := tc.HandshakeContext(hctx); err != nil {
		c.Close()
		return nil, err
	}
	return tc, nil
}

// readLog applies the log as the coordinator sends it; when the connection
// breaks, the process has lost the group.
func (g *CoordinatedGroup) readLog(m groupMember, c net.Conn, r *bufio.Reader) {
	defer g.wg.Done()
	for {
		msg, err := readGroupFrame(r)
		if err == nil && msg.typ != groupMsgBatch {
			err = fmt.Errorf("%w: message of type %d after the join", ErrBadGroupMessage, msg.typ)
		}
		if err != nil {
			g.leave(fmt.Errorf("the connection to the coordinator broke: %w", err))
			return
		}
		g.mu.Lock()
		if msg.proc == g.self && len(g.unacked) > 0 {
			g.unacked = g.unacked[1:]
		}
		g.mu.Unlock()
		m.apply(msg.events)
	}
}

// writeLog sends this process's events to the coordinator, in order.
func (g *CoordinatedGroup) writeLog(m groupMember, c net.Conn) {
	defer g.wg.Done()
	for {
		_, evs, ok := g.queue.pop()
		if !ok {
			return
		}
		b, n := encodeSome(g.self, evs)
		if n < len(evs) {
			// Too many bytes for one frame: the rest goes first next.
			g.queue.pushFront(g.self, evs[n:])
			evs = evs[:n]
		}
		g.mu.Lock()
		if g.failed != nil {
			g.mu.Unlock()
			g.echo.push(m, evs)
			continue
		}
		g.unacked = append(g.unacked, evs)
		g.mu.Unlock()
		c.SetWriteDeadline(time.Now().Add(g.cfg.WriteTimeout))
		if err := writeGroupFrame(c, b); err != nil {
			g.leave(fmt.Errorf("write to the coordinator: %w", err))
		}
	}
}

func (g *CoordinatedGroup) publish(evs ...instEvent) {
	g.mu.Lock()
	failed, m, coord, self := g.failed, g.m, g.coord, g.self
	g.mu.Unlock()
	if failed != nil && !coord {
		g.echo.push(m, evs)
		return
	}
	g.queue.push(self, evs)
}

// inherit takes the Transceiver's cluster secret and TLS where the config
// has none of its own, and the network its ranks dial on when a test
// injected one (nil: the machine's).
func (g *CoordinatedGroup) inherit(secret []byte, tc *transport.TLSConfig, nw network) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.net = nw
	if len(g.cfg.Secret) == 0 {
		g.cfg.Secret = secret
	}
	if g.cfg.TLS == nil && tc != nil && tc.Server != nil && tc.Client != nil {
		g.cfg.TLS = tc
	}
}

// leave: the other processes see this one go; what it publishes from now
// on is applied here only.
func (g *CoordinatedGroup) leave(err error) {
	g.mu.Lock()
	if g.failed != nil || g.m == nil {
		g.mu.Unlock()
		return
	}
	g.failed = fmt.Errorf("%w: %v", ErrGroupLost, err)
	failed, m := g.failed, g.m
	conns := slices.Clone(g.conns)
	for i := range g.conns {
		g.conns[i] = nil
	}
	unacked := g.unacked
	g.unacked = nil
	coord := g.coord
	g.mu.Unlock()
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
	ev := m.lost(failed)
	if coord {
		// The sequencer goes on, alone: the loss of every other rank
		// after what is queued, then what this process publishes.
		g.queue.push(g.self, []instEvent{ev})
		return
	}
	for _, evs := range unacked {
		g.echo.push(m, evs)
	}
	g.echo.push(m, []instEvent{ev})
}

func (g *CoordinatedGroup) close() error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	ln := g.ln
	g.mu.Unlock()
	g.leave(ErrClosed)
	if ln != nil {
		ln.Close()
	}
	g.queue.close()
	g.wg.Wait()
	g.echo.stop()
	return nil
}

// groupKeepAlive probes an idle group connection after 2 s, every second,
// 3 times: a process whose host died or was cut off without closing its
// connections is taken for gone within about 5 s, not at a transfer's
// deadline. (A process frozen on a live host answers the probes; it is
// found out when a write to it times out, WriteTimeout.)
var groupKeepAlive = net.KeepAliveConfig{Enable: true, Idle: 2 * time.Second, Interval: time.Second, Count: 3}

// keepAlive sets groupKeepAlive on an accepted connection (under TLS, on
// the TCP connection beneath).
func keepAlive(c net.Conn) {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetKeepAliveConfig(groupKeepAlive)
	}
}

// evQueue is an unbounded FIFO of batches, each with the process it is
// from; push never blocks.
type evQueue struct {
	mu     sync.Mutex
	items  []queued
	wake   chan struct{}
	closed bool
}

type queued struct {
	proc int
	evs  []instEvent
}

func (q *evQueue) push(proc int, evs []instEvent) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return
	}
	for len(evs) > 0 {
		n := min(len(evs), maxRoundEvents)
		q.items = append(q.items, queued{proc, slices.Clone(evs[:n])})
		evs = evs[n:]
	}
	q.signalLocked()
}

// pushFront puts evs back at the head of the queue.
func (q *evQueue) pushFront(proc int, evs []instEvent) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.items = append([]queued{{proc, evs}}, q.items...)
	q.signalLocked()
}

func (q *evQueue) signalLocked() {
	if q.wake == nil {
		q.wake = make(chan struct{}, 1)
	}
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// pop returns the next batch, waiting for one; ok is false once the queue
// is closed and empty.
func (q *evQueue) pop() (proc int, evs []instEvent, ok bool) {
	for {
		q.mu.Lock()
		if len(q.items) > 0 {
			it := q.items[0]
			q.items = q.items[1:]
			q.mu.Unlock()
			return it.proc, it.evs, true
		}
		if q.closed {
			q.mu.Unlock()
			return 0, nil, false
		}
		if q.wake == nil {
			q.wake = make(chan struct{}, 1)
		}
		wake := q.wake
		q.mu.Unlock()
		<-wake
	}
}

func (q *evQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.signalLocked()
	q.mu.Unlock()
}
