package membershiptest

import (
	"net"
	"sync"
	"testing"
	"time"
)

// StallProxy forwards TCP connections to a target and can hold back what
// the target sends (Stall: the store is slow to answer) or both directions
// (Block: the store is unreachable), for a while. Its goroutines end with
// Close, which the test's cleanup calls.
type StallProxy struct {
	ln     net.Listener
	target string

	mu         sync.Mutex
	replyUntil time.Time // replies wait until then
	bothUntil  time.Time // both directions wait until then
	conns      map[net.Conn]bool
	closed     bool
	wg         sync.WaitGroup
}

// NewStallProxy listens on a free loopback port and forwards to target.
func NewStallProxy(t testing.TB, target string) *StallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &StallProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port.
func (p *StallProxy) Addr() string { return p.ln.Addr().String() }

// Stall holds back the target's replies for d from now: requests still
// reach the target at once.
func (p *StallProxy) Stall(d time.Duration) {
	p.mu.Lock()
	p.replyUntil = time.Now().Add(d)
	p.mu.Unlock()
}

// Block holds back both directions for d from now.
func (p *StallProxy) Block(d time.Duration) {
	p.mu.Lock()
	p.bothUntil = time.Now().Add(d)
	p.mu.Unlock()
}

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines.
func (p *StallProxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}

func (p *StallProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			s.Close()
			return
		}
		p.conns[c], p.conns[s] = true, true
		p.wg.Add(2)
		p.mu.Unlock()
		go p.pump(s, c, false)
		go p.pump(c, s, true)
	}
}

// pump copies from src to dst, waiting before each write while the
// direction is held back.
func (p *StallProxy) pump(dst, src net.Conn, reply bool) {
	defer p.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.hold(reply)
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil { // io.EOF or a closed connection: done
			return
		}
	}
}

func (p *StallProxy) hold(reply bool) {
	for {
		p.mu.Lock()
		until := p.bothUntil
		if reply && p.replyUntil.After(until) {
			until = p.replyUntil
		}
		closed := p.closed
		p.mu.Unlock()
		d := time.Until(until)
		if d <= 0 || closed {
			return
		}
		time.Sleep(min(d, 50*time.Millisecond))
	}
}
