package tcp

import (
	"net"

	"github.com/kvxfer/kvxfer/internal/netlimit"
)

// vecReader reads a connection into several buffers at once: the spans of
// a receipt that a frame covers, and the padding after them. On a plain TCP
// connection on Linux that is one readv system call for up to maxIovecs
// buffers, as many bytes as the socket holds; elsewhere (TLS, other
// systems) one Read into the first non-empty buffer. A receiver that
// scatters a frame into many short spans (32 KiB per block and layer for a
// context TP2 -> generation TP1 pairing of a Llama shape) would otherwise
// pay a system call, and often a wake-up, per span.
type vecReader struct {
	nc  net.Conn
	sys *sysReader // nil: no vectored reads on nc
}

// newVecReader returns the vecReader of nc; raw is the accepted
// connection under it (nc itself without TLS), which the listener's
// connection caps may wrap. maxLowat bounds how many bytes a reader waits
// for before it is woken (see sysReader).
func newVecReader(nc, raw net.Conn, maxLowat int) vecReader {
	v := vecReader{nc: nc}
	if nc == raw {
		v.sys = newSysReader(netlimit.Unwrap(raw), maxLowat)
	}
	return v
}

// resetLowat has the reader woken by any byte again, before it reads
// anything but the rest of a frame (see sysReader).
func (v *vecReader) resetLowat() {
	if v.sys != nil {
		v.sys.resetLowat()
	}
}

// read reads into bufs, in order, and returns the count read: at least one
// byte, or an error (io.EOF at the end of the stream). bufs must hold at
// least one non-empty buffer.
func (v *vecReader) read(bufs [][]byte) (int, error) {
	if v.sys != nil {
		return v.sys.readv(bufs)
	}
	for _, b := range bufs {
		if len(b) > 0 {
			return v.nc.Read(b)
		}
	}
	panic("tcp: vectored read into nothing")
}

// skip returns bufs without their first n bytes.
func skip(bufs [][]byte, n int) [][]byte {
	for n > 0 {
		if n < len(bufs[0]) {
			bufs[0] = bufs[0][n:]
			return bufs
		}
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	return bufs
}
