//go:build unix

package config

import (
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// readPipe reads the named pipe at path, at most limit bytes. It opens it
// without waiting for a writer (a blocking open would wait for one
// forever), then waits at most within for a writer to write or to close,
// and at most within for each read after that. Its errors say what the
// pipe is or did, for the caller to prefix with the path.
func readPipe(path string, limit int64, within time.Duration) ([]byte, error) {
	fh, err := os.OpenFile(path, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	ready, err := waitWriter(fh, within)
	if err != nil {
		return nil, err
	}
	if !ready {
		return nil, fmt.Errorf("is a named pipe that nobody wrote to within %v (a writer must open it and write to it, as <(...) does)", within)
	}
	data, err := io.ReadAll(io.LimitReader(&idleReader{f: fh, within: within}, limit))
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil, fmt.Errorf("is a named pipe whose writer sent nothing for %v after %d bytes", within, len(data))
	}
	return data, err
}

// waitWriter waits at most within for the pipe fh to have data or to have
// had a writer that closed it, and reports whether it does. A read cannot
// tell: it gives end of file both before a writer came and after it left;
// poll(2) tells them apart (on Linux, POLLHUP only once a writer has left).
func waitWriter(fh *os.File, within time.Duration) (bool, error) {
	rc, err := fh.SyscallConn()
	if err != nil {
		return false, err
	}
	deadline := time.Now().Add(within)
	var ready bool
	var perr error
	err = rc.Control(func(fd uintptr) {
		for {
			left := time.Until(deadline)
			if left <= 0 {
				return
			}
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			// Rounded up, so that a wait below a millisecond is not a
			// busy loop of zero timeouts.
			n, err := unix.Poll(fds, int((left+time.Millisecond-1)/time.Millisecond))
			switch {
			case err == unix.EINTR:
				continue
			case err != nil:
				perr = err
				return
			case n > 0:
				ready = true
				return
			}
		}
	})
	if err == nil {
		err = perr
	}
	return ready, err
}

// idleReader reads f, each read within the given time.
type idleReader struct {
	f      *os.File
	within time.Duration
}

func (r *idleReader) Read(p []byte) (int, error) {
	// A file the runtime cannot poll has no deadlines; it was opened
	// non-blocking, so a read with nothing to read fails rather than wait.
	r.f.SetReadDeadline(time.Now().Add(r.within))
	return r.f.Read(p)
}
