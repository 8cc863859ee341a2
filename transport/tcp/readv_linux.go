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
type sysReader struct {
	rc    syscall.RawConn
	iov   []unix.Iovec
	n     int
	errno syscall.Errno
	fn    func(fd uintptr) bool // sysReader.call, bound once: no allocation per read
}

// newSysReader returns the sysReader of a *net.TCPConn, else nil.
func newSysReader(nc net.Conn) *sysReader {
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		return nil
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil
	}
	s := &sysReader{rc: rc}
	s.fn = s.call
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
	s.n, s.errno = 0, 0
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
