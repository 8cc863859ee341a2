package tcp

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/conn"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// prefaceTimeout bounds the wait for a new connection's preface.
const prefaceTimeout = 10 * time.Second

// scratchBytes is the size of the per-connection buffer that frames for
// unknown or ended receipts are read into and dropped.
const scratchBytes = 64 << 10

// errLetGo tells a reader that the receipt it is reading into has ended: it
// stops writing into dst and drops the rest of the frame.
var errLetGo = errors.New("tcp: receipt ended")

// errIdle ends an inbound connection that carried no frame for the idle
// timeout (Options.IdleTimeout), at a frame boundary: a clean end.
var errIdle = errors.New("tcp: data connection idle")

// aLongTimeAgo is a read deadline in the past: setting it makes a blocked
// Read return at once (net/http uses the same trick).
var aLongTimeAgo = time.Unix(1, 0)

// filling is what the backend knows of the filling of a receipt. Guarded
// by Transport.mu.
type filling struct {
	session  *session // the sender session it is bound to; nil before a frame
	received int64    // bytes of completed frames
}

// recv is one armed receipt. Readers test Ended after every Read without
// the lock.
type recv = receipt.Recv[filling]

// session groups the inbound connections of one sending Transport (the id in
// their preface). Guarded by Transport.mu.
type session struct {
	id    uint64
	conns int
}

// inConn is an accepted data connection and its reader's state.
type inConn struct {
	nc      net.Conn // what the reader reads: raw, or a *tls.Conn over it
	raw     net.Conn // the TCP connection; closing it ends nc at once
	remote  string
	sess    *session
	cur     *recv // receipt a frame is being read into; guarded by t.mu
	hdr     [headerLen]byte
	scratch []byte
	vr      vecReader
	vec     [][]byte // the buffers of the frame being read
	// idleAt is the read deadline of the frame being read, or waited for:
	// the idle timeout after the previous one ended (zero: none). Reader
	// only.
	idleAt time.Time
}

// Expect arms a receipt of sum(len(dst[i])) bytes under a fresh random tag.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	return t.receipts.Expect(dst)
}

// interrupt makes the readers in the middle of a frame for r, which has
// ended, let go of it after at most the Read in progress: their read
// deadline is set in the past, and they drop the rest of the frame into
// scratch, so the connection stays usable. t.mu is held.
func (t *Transport) interrupt(r *recv) {
	for c := range t.inbound {
		if c.cur == r {
			c.nc.SetReadDeadline(aLongTimeAgo)
		}
	}
}

// unstick closes the connections whose readers did not let go of r within
// cancelGrace of its Cancel.
func (t *Transport) unstick(r *recv) {
	t.mu.Lock()
	var stuck []*inConn
	for c := range t.inbound {
		if c.cur == r {
			stuck = append(stuck, c)
		}
	}
	t.mu.Unlock()
	for _, c := range stuck {
		t.log.Warn("tcp: closing a connection whose reader did not let go of a cancelled receipt", "remote", c.remote)
		c.raw.Close()
	}
}

// serve runs the reader of one accepted connection.
func (t *Transport) serve(c *inConn) {
	defer t.wg.Done()
	err := t.readLoop(c)
	// At a frame boundary (else ErrUnexpectedEOF, or a stall inside a
	// frame).
	clean := errors.Is(err, io.EOF) || err == errIdle
	var herr *handshakeError
	switch {
	case errors.As(err, &herr) && !errors.Is(err, net.ErrClosed):
		t.closes.Warn("tls", "tcp: refused a data connection: TLS handshake failed", "remote", c.remote, "err", herr.err)
	case err == errIdle:
		t.log.Debug("tcp: closed an idle data connection", "remote", c.remote, "idle_timeout", t.opts.IdleTimeout)
	case errors.Is(err, transport.ErrProtocol):
		t.closes.Warn("protocol", "tcp: closing data connection", "remote", c.remote, "err", err)
	default:
		conn.LogEnd(t.log, "tcp", "data connection", c.remote, err)
	}
	lost := peerLost("receive from", c.remote, err)
	t.mu.Lock()
	delete(t.inbound, c)
	if s := c.sess; s != nil {
		s.conns--
		// A connection that broke (not a clean end between frames) may
		// have lost bytes of any receipt of its sender; one whose sender
		// has no connection left has nobody to complete it.
		if !clean || s.conns == 0 {
			for r := range t.receipts.AllLocked() {
				if r.Fill.session == s {
					r.FinishLocked(lost)
				}
			}
		}
		if s.conns == 0 && t.sessions[s.id] == s {
			delete(t.sessions, s.id)
		}
	}
	t.mu.Unlock()
	c.raw.Close()
}

// handshakeError is a failed TLS handshake of an accepted connection.
type handshakeError struct{ err error }

func (e *handshakeError) Error() string { return "tcp: TLS handshake: " + e.err.Error() }
func (e *handshakeError) Unwrap() error { return e.err }

// readLoop reads the preface and then frames until the connection ends or
// breaks the protocol; it returns why.
func (t *Transport) readLoop(c *inConn) error {
	// Nobody can interrupt this read (no receipt uses the connection yet),
	// so a plain deadline bounds how long a silent connection is kept,
	// TLS handshake included.
	var pre [prefaceLen]byte
	c.raw.SetDeadline(time.Now().Add(prefaceTimeout))
	if tc, ok := c.nc.(*tls.Conn); ok {
		if err := tc.Handshake(); err != nil {
			return &handshakeError{err}
		}
	}
	if _, err := io.ReadFull(c.nc, pre[:]); err != nil {
		return err
	}
	id, err := decodePreface(pre[:])
	if err != nil {
		return err
	}
	if _, err := c.nc.Write([]byte{acceptByte}); err != nil {
		return err
	}
	c.raw.SetDeadline(time.Time{})
	t.mu.Lock()
	s := t.sessions[id]
	if s == nil {
		s = &session{id: id}
		t.sessions[id] = s
	}
	s.conns++
	c.sess = s
	t.mu.Unlock()

	for {
		c.vr.resetLowat()
		if t.opts.IdleTimeout > 0 {
			// No receipt is being read into (c.cur is nil): no interrupt
			// can be pending that this would undo.
			c.idleAt = time.Now().Add(t.opts.IdleTimeout)
			c.nc.SetReadDeadline(c.idleAt)
		}
		if n, err := t.readFull(c, c.hdr[:]); err != nil {
			if n == 0 && errors.Is(err, errStalled) {
				return errIdle // between frames
			}
			return err
		}
		h, err := decodeHeader(c.hdr[:])
		if err != nil {
			return err
		}
		if h.typ == frameAbort {
			t.mu.Lock()
			if r := t.receipts.LookupLocked(h.tag); r != nil {
				r.FinishLocked(fmt.Errorf("tcp: receive from %s: %w", c.remote, transport.ErrAborted))
			}
			t.mu.Unlock()
			continue
		}
		if err := t.readData(c, h); err != nil {
			return err
		}
	}
}

// readData reads the payload of a DATA frame straight into its receipt's
// dst, or into scratch when the receipt is unknown or has ended.
func (t *Transport) readData(c *inConn, h frameHeader) error {
	n, off := int64(h.length), int64(h.offset)
	pad := padLen(n)
	t.mu.Lock()
	r := t.receipts.LookupLocked(h.tag)
	switch {
	case r == nil:
		t.mu.Unlock()
		return t.discard(c, n+pad)
	case n > r.Total() || off > r.Total()-n:
		err := fmt.Errorf("%w: frame [%d, %d) beyond the receipt's %d bytes", transport.ErrProtocol, off, off+n, r.Total())
		r.FinishLocked(peerLost("receive from", c.remote, err))
		t.mu.Unlock()
		return err
	case r.Fill.session == nil:
		r.Fill.session = c.sess
	case r.Fill.session != c.sess:
		// The descriptor went to two senders; neither can be trusted
		// with the bytes of the other.
		r.FinishLocked(fmt.Errorf("tcp: receive from %s: %w: frames from a second sender", c.remote, transport.ErrProtocol))
		t.mu.Unlock()
		return t.discard(c, n+pad)
	}
	r.HoldLocked()
	c.cur = r
	t.mu.Unlock()

	// The payload and its padding, in one vectored read when the socket
	// holds them.
	c.vec = r.Dst().Append(c.vec[:0], off, n)
	if pad > 0 {
		c.vec = append(c.vec, c.hdr[:pad])
	}
	done, err := t.readInto(c, r, c.vec, n+pad)
	clear(c.vec) // do not keep dst reachable

	t.mu.Lock()
	c.cur = nil
	r.ReleaseLocked()
	switch {
	case err == errLetGo:
	case done >= n: // the payload is in, whatever became of the padding
		if !r.Ended() {
			r.Fill.received += n
			switch {
			case r.Fill.received == r.Total():
				r.FinishLocked(nil)
			case r.Fill.received > r.Total(): // overlapping frames: a hole somewhere
				r.FinishLocked(fmt.Errorf("tcp: receive from %s: %w: more bytes than the receipt's %d", c.remote, transport.ErrProtocol, r.Total()))
			}
		}
	default:
		r.FinishLocked(peerLost("receive from", c.remote, err))
	}
	t.mu.Unlock()
	switch {
	case err == errLetGo:
		return t.discard(c, n+pad-done)
	case err != nil:
		return err
	}
	if !allZero(c.hdr[:pad]) {
		return fmt.Errorf("%w: non-zero padding after a data frame", transport.ErrProtocol)
	}
	return nil
}

// noEOF turns io.EOF, which readFull returns when it read nothing, into
// io.ErrUnexpectedEOF: the connection ended inside a frame.
func noEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// readInto fills bufs, total bytes, from c for receipt r, and returns the
// count read. It returns errLetGo, with the count read so far, as soon as r
// has ended; io.ErrUnexpectedEOF when the connection ends first.
func (t *Transport) readInto(c *inConn, r *recv, bufs [][]byte, total int64) (int64, error) {
	var n int64
	for n < total {
		m, err := c.vr.read(bufs)
		n += int64(m)
		if r.Ended() {
			return n, errLetGo
		}
		if err != nil && n < total {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if idle(c) {
					return n, stalled(n, total)
				}
				t.unkick(c)
				continue
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
		bufs = skip(bufs, m)
	}
	return n, nil
}

// readFull fills p from c, as io.ReadFull does (io.EOF only when nothing was
// read), riding over the read deadlines that finish sets to interrupt a
// reader.
func (t *Transport) readFull(c *inConn, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := c.nc.Read(p[n:])
		n += m
		if err != nil && n < len(p) {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if idle(c) {
					return n, stalled(n, len(p))
				}
				t.unkick(c)
				continue
			}
			if errors.Is(err, io.EOF) && n > 0 {
				err = io.ErrUnexpectedEOF
			}
			return n, err
		}
	}
	return n, nil
}

// unkick puts back the read deadline that interrupt replaced: the idle
// timeout's, or none. Under t.mu, so that it cannot undo a later
// interruption without the reader seeing it: finish sets the flag the
// reader tests before it sets the deadline.
func (t *Transport) unkick(c *inConn) {
	t.mu.Lock()
	c.nc.SetReadDeadline(c.idleAt)
	t.mu.Unlock()
}

// errStalled: a read passed the idle timeout's deadline.
var errStalled = errors.New("no byte for the idle timeout")

func stalled[N int | int64](n, of N) error {
	return fmt.Errorf("tcp: %w, %d of %d bytes read", errStalled, n, of)
}

// idle reports whether c's read deadline is its idle timeout's, passed
// (else it was an interrupt's).
func idle(c *inConn) bool {
	return !c.idleAt.IsZero() && !time.Now().Before(c.idleAt)
}

// discard reads and drops n bytes.
func (t *Transport) discard(c *inConn, n int64) error {
	c.vr.resetLowat()
	if c.scratch == nil {
		c.scratch = make([]byte, scratchBytes)
	}
	for n > 0 {
		p := c.scratch[:min(n, int64(len(c.scratch)))]
		if _, err := t.readFull(c, p); err != nil {
			return noEOF(err)
		}
		n -= int64(len(p))
	}
	return nil
}

// peerLost wraps cause as transport.ErrPeerLost of op with peer (see
// conn.PeerLost).
func peerLost(op, peer string, cause error) error { return conn.PeerLost("tcp", op, peer, cause) }
