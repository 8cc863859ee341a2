package control

import (
	"bufio"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// Conn is one control connection between a generation rank (which dialled
// it) and a context rank. Frames are written whole, one writer at a time; one reader
// goroutine per connection, owned by the Plane, reads them.
type Conn struct {
	id      uint64 // the Plane's name for it (set by Plane.track)
	c       net.Conn
	br      *bufio.Reader
	wmu     sync.Mutex // guards writing, queued and spare
	writing bool       // a Send is writing; it writes queued after its own
	queued  []byte     // frames waiting for the write in progress
	spare   []byte     // the buffer of the last write, for the next one
	peer    Peer       // from the peer's Hello
	dialled bool

	closeOnce sync.Once
	dead      chan struct{} // closed when the connection is closed
	err       error         // why it died; set before dead is closed

	probeOnce sync.Once
	probeErr  error       // the answer of Probe; set before probed
	probed    atomic.Bool // Probe has answered

	used  atomic.Int64 // unix nanoseconds of the last use (see Touch)
	users int          // dialled: callers of Dial not yet released (guarded by Plane.mu)
	takes uint64       // dialled: Dials that have returned it (guarded by Plane.mu)
}

// Peer is what the other side of a Conn told of itself in its Hello, and
// where it is. Of an accepted Conn's peer only Rank, Host and Endpoint are
// kept.
type Peer struct {
	Rank      int
	State     []byte   // its layout.CacheState, marshalled
	Host      string   // its host identity
	Backends  []string // the data planes it has open
	Endpoints []string // data-plane endpoint of each backend
	Endpoint  string   // the address dialled (dialled Conn) or the remote address (accepted)
}

// fromHello records what a Hello tells of the peer.
func (p *Peer) fromHello(h *wire.Hello) {
	p.Rank, p.State, p.Host, p.Backends, p.Endpoints = int(h.Rank), h.State, h.Host, h.Backends, h.Endpoints
}

// writeTimeout bounds a write of a frame, a dial with its handshake, and
// the arrival of a frame whose first byte has come.
const writeTimeout = 10 * time.Second

func newConn(c net.Conn, dialled bool) *Conn {
	return &Conn{c: c, br: bufio.NewReaderSize(c, 16<<10), dead: make(chan struct{}), dialled: dialled}
}

// ID returns the Plane's name for c, unique among the Plane's Conns, never
// 0.
func (c *Conn) ID() uint64 { return c.id }

// Peer returns what the peer told of itself. It does not change once the
// Handler or a caller of Dial has seen c.
func (c *Conn) Peer() Peer { return c.peer }

// Dialled reports whether this side dialled c.
func (c *Conn) Dialled() bool { return c.dialled }

// Probe runs f once for c and keeps its answer while c lives: an answer
// about the peer that holds as long as it stays connected (can this side
// reach its shared-memory endpoint?). The first caller runs f; callers
// meanwhile wait for it, later ones get its answer at once.
func (c *Conn) Probe(f func() error) error {
	c.probeOnce.Do(func() {
		c.probeErr = f()
		c.probed.Store(true)
	})
	return c.probeErr
}

// Probed returns Probe's answer, and whether it has been given (false
// while none was asked or the first is running).
func (c *Conn) Probed() (err error, answered bool) {
	if !c.probed.Load() {
		return nil, false
	}
	return c.probeErr, true
}

// Send writes one frame whole. A write that cannot finish within
// writeTimeout kills the connection: a control peer that does not read is
// gone. On a dead Conn it fails with ErrPeerLost.
//
// Frames sent while another Send is writing are gathered, and the writer
// writes them after its own in one write (a small frame costs a system
// call, and the peer a read, as much as a large one): such a Send returns
// nil once its frame is queued, and should that write fail, the connection
// closes and its Handler learns it (Lost), as with any failed write.
func (c *Conn) Send(f wire.Frame) error {
	c.wmu.Lock()
	select {
	case <-c.dead:
		c.wmu.Unlock()
		return fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, c.peer.Endpoint, c.err)
	default:
	}
	var err error
	if c.queued, err = wire.Append(c.queued, f); err != nil {
		c.wmu.Unlock()
		return err
	}
	if c.writing {
		c.wmu.Unlock()
		return nil
	}
	c.writing = true
	for len(c.queued) > 0 {
		b := c.queued
		c.queued = c.spare[:0]
		c.wmu.Unlock()
		c.c.SetWriteDeadline(time.Now().Add(writeTimeout))
		_, err := c.c.Write(b)
		c.wmu.Lock()
		c.spare = nil // (never the buffer queued is in)
		if cap(b) <= maxSpare {
			c.spare = b[:0]
		}
		if err != nil {
			c.writing, c.queued = false, nil
			c.wmu.Unlock()
			c.close(err)
			return fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, c.peer.Endpoint, err)
		}
	}
	c.writing = false
	c.wmu.Unlock()
	return nil
}

// maxSpare bounds the write buffer a Conn keeps between writes.
const maxSpare = 64 << 10

// Touch records that c is in use now: its idle time starts again.
func (c *Conn) Touch() { c.used.Store(time.Now().UnixNano()) }

// lastUse returns when c was last used (see Touch).
func (c *Conn) lastUse() time.Time { return time.Unix(0, c.used.Load()) }

// isDead reports whether c has been closed.
func (c *Conn) isDead() bool {
	select {
	case <-c.dead:
		return true
	default:
		return false
	}
}

// close closes the connection once, recording why.
func (c *Conn) close(why error) {
	c.closeOnce.Do(func() {
		c.err = why
		c.c.Close()
		close(c.dead)
	})
}
