package tcp

import (
	"net"
	"sync"
)

// batchBytes is how many bytes of TLS records batchConn gathers before it
// writes them.
const batchBytes = 256 << 10

// batchConn sits between a sending *tls.Conn and its TCP connection.
// crypto/tls writes every record (at most 16 KiB of payload) with a Write
// call of its own, which is a system call per record; while a frame is
// written (between begin and end) batchConn gathers the records and writes
// up to batchBytes at a time. Outside a frame (the handshake, the preface,
// alerts) it writes straight through, so that nothing waits in it.
type batchConn struct {
	net.Conn
	mu  sync.Mutex // crypto/tls may write from its reader (a key update) too
	on  bool
	buf []byte
}

func newBatchConn(c net.Conn) *batchConn { return &batchConn{Conn: c} }

// Write gathers p while a frame is written, or writes it through.
func (b *batchConn) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.on {
		return b.Conn.Write(p)
	}
	if len(b.buf)+len(p) > batchBytes {
		if err := b.flush(); err != nil {
			return 0, err
		}
	}
	if len(p) >= batchBytes {
		return b.Conn.Write(p)
	}
	if b.buf == nil {
		b.buf = make([]byte, 0, batchBytes)
	}
	b.buf = append(b.buf, p...)
	return len(p), nil
}

// begin starts gathering.
func (b *batchConn) begin() {
	b.mu.Lock()
	b.on = true
	b.mu.Unlock()
}

// end writes what was gathered and stops gathering.
func (b *batchConn) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.on = false
	return b.flush()
}

// flush writes the gathered bytes; b.mu must be held. After an error the
// connection is unusable (the caller drops it), so the bytes are dropped.
func (b *batchConn) flush() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.Conn.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}
