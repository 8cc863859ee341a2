//go:build linux

package shm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/memfd"
)

const (
	// readBufStart is the initial size of a connection's read buffer; it
	// grows, up to one whole message, when a longer message arrives.
	readBufStart = 16 << 10
	// maxStuckCloses bounds the closes of peers' descriptors that run on
	// goroutines of their own (closeReceived), in the whole process: a
	// close can block for as long as the peer likes (a FUSE file's
	// flush). Beyond that, such a close runs on the reader of the peer's
	// connection.
	maxStuckCloses = 16
)

// stuckCloses holds a token per close in flight on a goroutine of its own
// (closeReceived).
var stuckCloses = make(chan struct{}, maxStuckCloses)

// aLongTimeAgo is a deadline in the past: setting it makes blocked I/O
// return at once (net/http uses the same trick).
var aLongTimeAgo = time.Unix(1, 0)

// msgReader reads messages, and the descriptors that come with them, from
// a Unix stream connection. It is used by one goroutine at a time.
//
// Descriptors sent with SCM_RIGHTS arrive with the first byte of the
// sendmsg that carried them, and the kernel never returns the bytes of two
// such sendmsg calls in one recvmsg; so by the time a WINDOW message has
// been read, its descriptor is in fds, in order.
//
// A reader takes only the descriptors it expects (want: a receiver's one
// WINDOW descriptor; a sender's none). A recvmsg gives the kernel room for
// exactly one descriptor while one is expected and for none otherwise
// (a control buffer of CmsgLen(4) bytes: CmsgSpace(4), padded, would fit
// two), so the kernel drops any other a peer sends without installing it
// here (MSG_CTRUNC, a protocol error): no close of ours runs for it, and
// none can block. A descriptor taken that turns out not to be shared
// memory is closed by closeReceived.
type msgReader struct {
	nc   *net.UnixConn
	buf  []byte
	r, w int // unread bytes are buf[r:w]
	oob  []byte
	want int   // descriptors still expected (taken ones included)
	fds  []int // received, not yet claimed by a WINDOW (at most one)
}

// newMsgReader returns a reader of nc that takes no descriptor; a
// receiver sets want to 1 for its WINDOW's.
func newMsgReader(nc *net.UnixConn) *msgReader {
	return &msgReader{
		nc:  nc,
		buf: make([]byte, readBufStart),
		oob: make([]byte, syscall.CmsgLen(4)),
	}
}

// next returns the next message. io.EOF means the peer closed the
// connection between messages; io.ErrUnexpectedEOF, inside one.
func (mr *msgReader) next() (msg, error) {
	for {
		m, n, err := decodeMsg(mr.buf[mr.r:mr.w])
		if err != nil {
			return msg{}, err
		}
		if n > 0 {
			mr.r += n
			return m, nil
		}
		if err := mr.fill(); err != nil {
			return msg{}, err
		}
	}
}

// fill reads more bytes, making room for at least one whole message.
func (mr *msgReader) fill() error {
	need := hdrLen
	if mr.w-mr.r >= hdrLen {
		need, _ = msgLen(mr.buf[mr.r : mr.r+hdrLen]) // checked by decodeMsg
	}
	if mr.r > 0 && len(mr.buf)-mr.r < need {
		mr.w = copy(mr.buf, mr.buf[mr.r:mr.w])
		mr.r = 0
	}
	if len(mr.buf) < need {
		nb := make([]byte, max(need, 2*len(mr.buf)))
		mr.w = copy(nb, mr.buf[mr.r:mr.w])
		mr.r = 0
		mr.buf = nb
	}
	// Room for a descriptor only while one is expected.
	var oob []byte
	if mr.want > len(mr.fds) {
		oob = mr.oob
	}
	w0 := mr.w
	n, oobn, flags, _, err := mr.nc.ReadMsgUnix(mr.buf[mr.w:], oob)
	// A failed recvmsg returns n = -1. A read deadline is not the end: the
	// reader may call next again and find what it had read of a message
	// (the idle check does), so the buffer must stay as it was.
	n = max(n, 0)
	if oobn > 0 {
		if ferr := mr.takeFds(oob[:oobn]); ferr != nil {
			return ferr
		}
		// The bytes that came with a descriptor must be a whole WINDOW,
		// with nothing unread before it: a legitimate sender writes it,
		// with its descriptor, in one sendmsg, after the receiver's
		// HELLO (the kernel ends a recvmsg after the bytes of a sendmsg
		// that carried descriptors, though it may start it with earlier
		// bytes).
		if w0 != mr.r || n < hdrLen+8 || mr.buf[w0] != msgWindow {
			mr.closeFds()
			return errProto("a descriptor came with bytes that are not a whole WINDOW message")
		}
	}
	if flags&syscall.MSG_CTRUNC != 0 {
		if mr.want == 0 {
			return errProto("descriptors sent where none is taken (the kernel dropped them)")
		}
		return errProto("descriptors sent beyond the window's one (the kernel dropped them)")
	}
	mr.w += n
	switch {
	case err != nil:
		if errors.Is(err, io.EOF) && mr.w > mr.r {
			return io.ErrUnexpectedEOF
		}
		return err
	case n == 0: // a stream socket's end
		if mr.w > mr.r {
			return io.ErrUnexpectedEOF
		}
		return io.EOF
	}
	return nil
}

// takeFds keeps the descriptors of SCM_RIGHTS messages in oob (closing all
// of them when anything is wrong).
func (mr *msgReader) takeFds(oob []byte) error {
	cms, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return errProto("control message: %v", err)
	}
	var bad error
	for _, cm := range cms {
		fds, err := syscall.ParseUnixRights(&cm)
		if err != nil {
			if bad == nil {
				bad = errProto("control message of level %d type %d", cm.Header.Level, cm.Header.Type)
			}
			continue
		}
		mr.fds = append(mr.fds, fds...)
	}
	if bad == nil && len(mr.fds) > mr.want {
		bad = errProto("%d descriptors received, %d expected", len(mr.fds), mr.want)
	}
	if bad != nil {
		mr.closeFds()
	}
	return bad
}

// takeFd returns the received descriptor, which the caller owns; it is
// no longer expected.
func (mr *msgReader) takeFd() (int, bool) {
	if len(mr.fds) == 0 {
		return -1, false
	}
	fd := mr.fds[0]
	mr.fds = mr.fds[1:]
	mr.want--
	return fd, true
}

// closeFds closes every descriptor received and not claimed.
func (mr *msgReader) closeFds() {
	for _, fd := range mr.fds {
		closeReceived(fd)
	}
	mr.fds = nil
}

// closeReceived closes a descriptor a peer sent, without letting the peer
// make the close block its caller where it can: close(2) of a socket with
// SO_LINGER and unsent data waits for the linger time, so a socket's
// linger is cut to zero first; a file that is neither shared memory nor a
// socket (a FUSE file can block in its flush for as long as its server
// likes) is closed on a goroutine of its own, which nothing waits for,
// holding a token of stuckCloses until the close returns. With every token
// held, the close runs on the caller: the reader of the peer's connection,
// which then stays open (counted against MaxConns) until it returns. A
// reader takes one descriptor per connection, so what a peer can leave
// blocked is bounded by the connections it may hold.
func closeReceived(fd int) {
	var st unix.Stat_t
	if unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFSOCK {
		unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
		unix.Close(fd)
		return
	}
	if memfd.IsShmem(fd) {
		unix.Close(fd)
		return
	}
	select {
	case stuckCloses <- struct{}{}:
		go func() {
			defer func() { <-stuckCloses }()
			unix.Close(fd)
		}()
	default:
		unix.Close(fd)
	}
}

// writeFull writes b, and oob with its first byte. A stream sendmsg may
// write part of b; the rest follows without oob (the descriptors travel
// with the first part).
func writeFull(nc *net.UnixConn, b, oob []byte) error {
	if oob == nil {
		_, err := nc.Write(b)
		return err
	}
	n, _, err := nc.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return err
	}
	if n < len(b) {
		_, err = nc.Write(b[n:])
	}
	return err
}

// dialUnix connects to an abstract socket and exchanges HELLOs, within
// ctx and at most limit. It returns the connection and its reader.
func dialUnix(ctx context.Context, ep string, limit time.Duration) (*net.UnixConn, *msgReader, error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", ep)
	if err != nil {
		return nil, nil, fmt.Errorf("dial: %w", err)
	}
	nc := c.(*net.UnixConn)
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		nc.SetDeadline(aLongTimeAgo)
	})
	mr, err := hello(nc)
	if !stop() {
		<-fired // the deadline is set: the connection is of no use
		if err == nil {
			mr.closeFds()
			err = ctx.Err()
		}
	}
	if err != nil {
		nc.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("hello: %w (%w)", ctx.Err(), err)
		} else {
			err = fmt.Errorf("hello: %w", err)
		}
		return nil, nil, err
	}
	nc.SetDeadline(time.Time{})
	return nc, mr, nil
}

// hello writes our HELLO and reads the peer's.
func hello(nc *net.UnixConn) (*msgReader, error) {
	if err := writeFull(nc, appendMsg(nil, &msg{typ: msgHello, version: protoVersion}), nil); err != nil {
		return nil, err
	}
	mr := newMsgReader(nc)
	m, err := mr.next()
	if err != nil {
		mr.closeFds()
		return nil, err
	}
	if err := checkHello(m); err != nil {
		mr.closeFds()
		return nil, err
	}
	return mr, nil
}

// checkHello checks that m is a HELLO of our protocol version.
func checkHello(m msg) error {
	if m.typ != msgHello {
		return errProto("message type %d before hello", m.typ)
	}
	if m.version != protoVersion {
		return errProto("protocol version %d, want %d", m.version, protoVersion)
	}
	return nil
}

// peerName names the process at the other end of nc for logs and errors.
func peerName(nc *net.UnixConn) string {
	rc, err := nc.SyscallConn()
	if err != nil {
		return "unknown process"
	}
	var cred *syscall.Ucred
	rc.Control(func(fd uintptr) {
		cred, err = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	})
	if err != nil || cred == nil {
		return "unknown process"
	}
	return fmt.Sprintf("pid %d", cred.Pid)
}

// fdFile wraps a received descriptor in an *os.File that owns it.
func fdFile(fd int, name string) *os.File { return os.NewFile(uintptr(fd), name) }
