package memnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"
)

// ErrRefused is Dial's error when nothing listens at the address.
var ErrRefused = errors.New("memnet: connection refused")

// BufferBytes is how much one direction of a connection holds before a
// Write waits for the reader, as a socket's buffers do.
const BufferBytes = 1 << 20

// backlog is how many dialled connections a listener holds before Accept.
const backlog = 128

// Network is a set of listeners that dial each other. Safe for concurrent
// use; the zero value is not usable, New makes one.
type Network struct {
	mu        sync.Mutex
	listeners map[string]*Listener
	port      int // the last port handed out
}

// New returns an empty network.
func New() *Network { return &Network{listeners: map[string]*Listener{}, port: 20000} }

// Listen listens at host on a port of its own ("127.0.0.1" gives
// "127.0.0.1:20001", say). host must be an IP address.
func (n *Network) Listen(host string) (*Listener, error) {
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return nil, fmt.Errorf("memnet: listen at %q: %w", host, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.port++
	l := &Listener{n: n, addr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(n.port))),
		conns: make(chan net.Conn, backlog), done: make(chan struct{})}
	n.listeners[l.addr.String()] = l
	return l, nil
}

// Dial connects to the listener at addr ("host:port"), from a port of its
// own on the listener's host. It fails with ErrRefused when nothing
// listens there or the listener's backlog is full, and with ctx's error
// when ctx ends first.
func (n *Network) Dial(ctx context.Context, addr string) (net.Conn, error) {
	return n.DialFrom(ctx, "", addr)
}

// DialFrom is Dial from a port of host, an IP address ("" is the
// listener's host): the accepted connection's RemoteAddr is there.
func (n *Network) DialFrom(ctx context.Context, host, addr string) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: err}
	}
	var from netip.Addr
	if host != "" {
		var err error
		if from, err = netip.ParseAddr(host); err != nil {
			return nil, &net.OpError{Op: "dial", Net: "tcp", Err: fmt.Errorf("memnet: dial from %q: %w", host, err)}
		}
	}
	n.mu.Lock()
	l := n.listeners[addr]
	n.port++
	port := n.port
	n.mu.Unlock()
	if l == nil {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: fmt.Errorf("%w: %s", ErrRefused, addr)}
	}
	if !from.IsValid() {
		from = l.addr.AddrPort().Addr()
	}
	local := net.TCPAddrFromAddrPort(netip.AddrPortFrom(from, uint16(port)))
	client, server := Pipe(local, l.addr)
	select {
	case <-l.done:
	case <-ctx.Done():
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: ctx.Err()}
	case l.conns <- server:
		return client, nil
	default:
	}
	return nil, &net.OpError{Op: "dial", Net: "tcp", Err: fmt.Errorf("%w: %s", ErrRefused, addr)}
}

// Listener is a net.Listener of a Network.
type Listener struct {
	n     *Network
	addr  *net.TCPAddr
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

// Accept waits for the next connection dialled to l; after Close it fails
// with an error that unwraps to net.ErrClosed.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case <-l.done:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr, Err: net.ErrClosed}
	default:
	}
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.addr, Err: net.ErrClosed}
	}
}

// Close stops l: Accept fails, new dials are refused, and connections
// dialled but not accepted are closed. Idempotent.
func (l *Listener) Close() error {
	l.once.Do(func() {
		l.n.mu.Lock()
		delete(l.n.listeners, l.addr.String())
		l.n.mu.Unlock()
		close(l.done)
		for {
			select {
			case c := <-l.conns:
				c.Close()
			default:
				return
			}
		}
	})
	return nil
}

// Addr returns where l listens, a *net.TCPAddr.
func (l *Listener) Addr() net.Addr { return l.addr }

// Pipe returns the two ends of a connection between the addresses a and b:
// what one writes the other reads, buffered up to BufferBytes each way.
func Pipe(a, b net.Addr) (net.Conn, net.Conn) {
	ab, ba := newPipe(), newPipe()
	return &Conn{local: a, remote: b, rd: ba, wr: ab}, &Conn{local: b, remote: a, rd: ab, wr: ba}
}

// pipe is one direction of a connection.
type pipe struct {
	mu       sync.Mutex
	buf      []byte
	eof      bool          // the writer closed: reads drain buf, then io.EOF
	gone     bool          // the reader closed: writes fail
	readable chan struct{} // a token when buf, eof or gone may have changed for the reader
	writable chan struct{} // a token when room or gone may have changed for the writer
	rdl, wdl deadline
}

func newPipe() *pipe {
	p := &pipe{readable: make(chan struct{}, 1), writable: make(chan struct{}, 1)}
	p.rdl.init(p.readable)
	p.wdl.init(p.writable)
	return p
}

func kick(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// deadline is one deadline of a pipe: expired once its time has passed.
type deadline struct {
	mu      sync.Mutex
	wake    chan struct{} // kicked when it expires or changes
	timer   *time.Timer
	expired bool
}

func (d *deadline) init(wake chan struct{}) { d.wake = wake }

func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	d.expired = false
	if !t.IsZero() {
		if wait := time.Until(t); wait <= 0 {
			d.expired = true
		} else {
			var self *time.Timer
			self = time.AfterFunc(wait, func() {
				d.mu.Lock()
				if d.timer == self {
					d.expired = true
				}
				d.mu.Unlock()
				kick(d.wake)
			})
			d.timer = self
		}
	}
	kick(d.wake)
}

func (d *deadline) passed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.expired
}

// Conn is one end of a Pipe: a net.Conn.
type Conn struct {
	local, remote net.Addr
	rd, wr        *pipe
	once          sync.Once
}

func (c *Conn) opErr(op string, err error) error {
	return &net.OpError{Op: op, Net: "tcp", Source: c.local, Addr: c.remote, Err: err}
}

// Read reads what the peer wrote; io.EOF once the peer has closed and all
// it wrote is read.
func (c *Conn) Read(b []byte) (int, error) {
	p := c.rd
	for {
		p.mu.Lock()
		switch {
		case p.gone:
			p.mu.Unlock()
			return 0, c.opErr("read", net.ErrClosed)
		case len(p.buf) > 0:
			n := copy(b, p.buf)
			p.buf = p.buf[n:]
			if len(p.buf) == 0 {
				p.buf = nil
			}
			more := len(p.buf) > 0 || p.eof
			p.mu.Unlock()
			kick(p.writable)
			if more {
				kick(p.readable) // another reader may go on
			}
			return n, nil
		case p.eof:
			p.mu.Unlock()
			return 0, io.EOF
		case len(b) == 0:
			p.mu.Unlock()
			return 0, nil
		}
		p.mu.Unlock()
		if p.rdl.passed() {
			return 0, c.opErr("read", os.ErrDeadlineExceeded)
		}
		<-p.readable
	}
}

// Write writes b whole, waiting while the peer's buffer is full; it fails
// once either end has closed or the write deadline has passed.
func (c *Conn) Write(b []byte) (int, error) {
	p := c.wr
	done := 0
	for {
		p.mu.Lock()
		switch {
		case p.eof:
			p.mu.Unlock()
			return done, c.opErr("write", net.ErrClosed)
		case p.gone:
			p.mu.Unlock()
			return done, c.opErr("write", io.ErrClosedPipe)
		}
		if room := BufferBytes - len(p.buf); room > 0 && done < len(b) {
			n := min(room, len(b)-done)
			p.buf = append(p.buf, b[done:done+n]...)
			done += n
			p.mu.Unlock()
			kick(p.readable)
			continue
		}
		p.mu.Unlock()
		if done == len(b) {
			return done, nil
		}
		if p.wdl.passed() {
			return done, c.opErr("write", os.ErrDeadlineExceeded)
		}
		<-p.writable
	}
}

// Close closes both directions: the peer reads io.EOF after what was
// written, and its writes fail. Idempotent.
func (c *Conn) Close() error {
	c.once.Do(func() {
		for _, p := range []*pipe{c.rd, c.wr} {
			p.mu.Lock()
			if p == c.rd {
				p.gone, p.buf = true, nil
			} else {
				p.eof = true
			}
			p.mu.Unlock()
			kick(p.readable)
			kick(p.writable)
		}
		c.rd.rdl.set(time.Time{})
		c.wr.wdl.set(time.Time{})
	})
	return nil
}

// LocalAddr returns this end's address.
func (c *Conn) LocalAddr() net.Addr { return c.local }

// RemoteAddr returns the peer's address.
func (c *Conn) RemoteAddr() net.Addr { return c.remote }

// SetDeadline sets both deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

// SetReadDeadline makes a Read waiting then, or later, fail with
// os.ErrDeadlineExceeded once t has passed; the zero time clears it.
func (c *Conn) SetReadDeadline(t time.Time) error { c.rd.rdl.set(t); return nil }

// SetWriteDeadline does for writes what SetReadDeadline does for reads.
func (c *Conn) SetWriteDeadline(t time.Time) error { c.wr.wdl.set(t); return nil }

// String names the connection for logs.
func (c *Conn) String() string {
	return "memnet " + c.local.String() + "->" + c.remote.String()
}

var _ net.Conn = (*Conn)(nil)
