package transceiver

import (
	"bufio"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// ctrlConn is one control connection between a generation rank (which
// dialled it) and a context rank. Frames are written whole under wmu; one
// reader goroutine per connection, owned by the rank, reads them.
type ctrlConn struct {
	id   connID // the rank's name for it (set by rank.track)
	c    net.Conn
	br   *bufio.Reader
	wmu  sync.Mutex
	peer peerInfo // from the peer's Hello

	probeOnce sync.Once // shm probe of the peer, once per connection
	probeErr  error

	closeOnce sync.Once
	dead      chan struct{} // closed when the connection is closed
	err       error         // why it died; set before dead is closed

	now   func() time.Time // the rank's clock: idleness is measured on it
	used  atomic.Int64     // unix nanoseconds of the last frame or request ended (see touch)
	users int              // dialled connections: askers between dial and recording it (guarded by rank.mu)
}

// peerInfo is what a Hello tells about the other side.
type peerInfo struct {
	rank      int
	state     []byte
	host      string
	backends  []string
	endpoints []string // data-plane endpoint of each backend
	endpoint  string   // the address we dialled (generation side) or the remote address
}

// fromHello records what a Hello tells of the peer.
func (p *peerInfo) fromHello(h *wire.Hello) {
	p.rank, p.state, p.host, p.backends, p.endpoints = int(h.Rank), h.State, h.Host, h.Backends, h.Endpoints
}

const writeTimeout = 10 * time.Second

func newCtrlConn(c net.Conn, now func() time.Time) *ctrlConn {
	return &ctrlConn{c: c, br: bufio.NewReaderSize(c, 16<<10), dead: make(chan struct{}), now: now}
}

// send writes one frame. A write that cannot finish within writeTimeout
// kills the connection: a control peer that does not read is gone.
func (cc *ctrlConn) send(f wire.Frame) error {
	b, err := wire.Append(make([]byte, 0, 128), f)
	if err != nil {
		return err
	}
	cc.wmu.Lock()
	defer cc.wmu.Unlock()
	select {
	case <-cc.dead:
		return fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, cc.peer.endpoint, cc.err)
	default:
	}
	cc.c.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := cc.c.Write(b); err != nil {
		cc.close(err)
		return fmt.Errorf("%w: control connection to %s: %v", ErrPeerLost, cc.peer.endpoint, err)
	}
	return nil
}

// touch records that cc is in use now: its idle time starts again.
func (cc *ctrlConn) touch() { cc.used.Store(cc.now().UnixNano()) }

// lastUse returns when cc was last used (see touch).
func (cc *ctrlConn) lastUse() time.Time { return time.Unix(0, cc.used.Load()) }

// isDead reports whether cc has been closed.
func (cc *ctrlConn) isDead() bool {
	select {
	case <-cc.dead:
		return true
	default:
		return false
	}
}

// close closes the connection once, recording why.
func (cc *ctrlConn) close(why error) {
	cc.closeOnce.Do(func() {
		cc.err = why
		cc.c.Close()
		close(cc.dead)
	})
}
