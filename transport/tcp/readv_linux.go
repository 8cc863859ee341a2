package tcp

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIovecs is the most buffers one readv takes (IOV_MAX).
const maxIovecs = 1024

// sysReader reads a TCP connection with readv through its syscall.RawConn,
// so that the runtime's poller waits for it and read deadlines (which
// interrupt a reader, see Transport.interrupt) apply as to a Read.
//
// When a readv finds the socket empty, the reader is woken only once
// min(the bytes it asked for, maxLowat) have arrived (SO_RCVLOWAT), not at
// every segment: a reader that a sender outpaces wakes once per maxLowat
// bytes instead of once per 64 KiB and reads them with one readv. The bytes
// asked for are those of the frame being read, all of which the sender is
// writing, so the wait always ends. resetLowat sets it back to one byte
// before anything else is read (a header, whose frame may be the last).
type sysReader struct {
	rc      syscall.RawConn
	iov     []unix.Iovec
	n       int
	errno   syscall.Errno
	fn      func(fd uintptr) bool // sysReader.call, bound once: no allocation per read
	resetFn func(fd uintptr)      // sets SO_RCVLOWAT to 1, bound once
	want    int                   // bytes the readv in progress asks for
	lowat   int                   // SO_RCVLOWAT as last set; 1, the kernel's default, at first
	max     int                   // the most SO_RCVLOWAT is raised to; 0 or 1: never raised
}

// newSysReader returns the sysReader of a *net.TCPConn, else nil; maxLowat
// bounds its SO_RCVLOWAT (0 or 1: left at the kernel's one byte).
func newSysReader(nc net.Conn, maxLowat int) *sysReader {
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	s := &sysReader{rc: rc, lowat: 1, max: maxLowat}
	s.fn = s.call
	s.resetFn = func(fd uintptr) { s.setLowat(fd, 1) }
	return s
}

// call makes the readv; it returns false when the socket has nothing to
// read, which has the poller wait.
func (s *sysReader) call(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(&s.iov[0])), uintptr(len(s.iov)))
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			if s.max > 1 {
				s.setLowat(fd, min(s.want, s.max))
			}
			return false
		}
		s.n, s.errno = int(n), e
		return true
	}
}

// readv reads into up to maxIovecs buffers of bufs with one readv.
func (s *sysReader) readv(bufs [][]byte) (int, error) {
	s.iov = s.iov[:0]
	for _, b := range bufs {
		if len(s.iov) == maxIovecs {
			break
		}
		if len(b) > 0 {
			v := unix.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			s.iov = append(s.iov, v)
		}
	}
	if len(s.iov) == 0 {
		panic("tcp: vectored read into nothing")
	}
	s.n, s.errno, s.want = 0, 0, 0
	for _, v := range s.iov {
		s.want += int(v.Len)
	}
	err := s.rc.Read(s.fn)
	clear(s.iov) // do not keep the receipt's memory reachable
	switch {
	case err != nil: // a deadline, a closed connection
		return 0, err
	case s.errno != 0:
		return 0, &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("readv", s.errno)}
	case s.n == 0:
		return 0, io.EOF
	}
	raceWritten(bufs, s.n)
	return s.n, nil
}

// setLowat sets the socket's SO_RCVLOWAT to n unless it is n already. The
// kernel signals the poller at once when n bytes are queued already, so
// raising it after an empty readv loses no wake-up. A failure leaves it as
// it was: the reader is then only woken more often.
func (s *sysReader) setLowat(fd uintptr, n int) {
	if n == s.lowat {
		return
	}
	if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, n) == nil {
		s.lowat = n
	}
}

// resetLowat sets SO_RCVLOWAT back to one byte, before a read of anything
// but the rest of the frame it was raised for.
func (s *sysReader) resetLowat() {
	if s.lowat != 1 {
		s.rc.Control(s.resetFn)
	}
}
