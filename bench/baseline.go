package bench

import (
	"fmt"
	"io"
	"net"
	"time"
)

// Baselines are the machine's own limits, measured in the same run as the
// transfers so that ratios between them mean something on a noisy machine.
type Baselines struct {
	// RawTCPGBps is one plain TCP stream over loopback between the two
	// benchmark processes, moving the same bytes per request.
	RawTCPGBps float64 `json:"raw_tcp_gbps"`
	// CopyGBps is a single-threaded copy of the same bytes in this process.
	CopyGBps float64 `json:"copy_gbps"`
}

// rawTCP times a plain TCP stream of n bytes from the peer process to this
// one over loopback, best of rounds.
func (p *peerProc) rawTCP(n int64, rounds int) (float64, error) {
	best := 0.0
	for range rounds {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		if err := p.send(peerMsg{Op: "rawtcp", Opaque: ln.Addr().String(), Bytes: n}); err != nil {
			ln.Close()
			return 0, err
		}
		ln.(*net.TCPListener).SetDeadline(time.Now().Add(30 * time.Second))
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			return 0, fmt.Errorf("bench: raw TCP baseline: %w", err)
		}
		buf := make([]byte, 4<<20)
		start := time.Now()
		got, err := io.CopyBuffer(io.Discard, readerOnly{c}, buf)
		d := time.Since(start)
		c.Close()
		if err != nil || got != n {
			return 0, fmt.Errorf("bench: raw TCP baseline: read %d of %d bytes: %v", got, n, err)
		}
		if _, err := p.read(); err != nil { // the peer's "sent"
			return 0, err
		}
		best = max(best, float64(n)/d.Seconds()/1e9)
	}
	return best, nil
}

// readerOnly hides WriterTo/ReaderFrom so that io.CopyBuffer really copies
// through the user buffer, as a receiver writing into its own memory does.
type readerOnly struct{ r io.Reader }

func (r readerOnly) Read(b []byte) (int, error) { return r.r.Read(b) }

// sendRaw is the peer side of rawTCP.
func sendRaw(addr string, n int64) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 4<<20)
	quickFill(buf, 1)
	for n > 0 {
		k := min(n, int64(len(buf)))
		if _, err := c.Write(buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// copyGBps times a single-threaded copy of n bytes between two buffers,
// best of rounds.
func copyGBps(n int64, rounds int) float64 {
	n = min(n, 1<<30)
	src, dst := make([]byte, n), make([]byte, n)
	quickFill(src, 2)
	copy(dst, src) // touch the pages once
	best := 0.0
	for range rounds {
		start := time.Now()
		copy(dst, src)
		best = max(best, float64(n)/time.Since(start).Seconds()/1e9)
	}
	return best
}
