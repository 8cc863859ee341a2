package crosshost

import (
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// faults is what the proxy does to the bytes it forwards, per direction
// of each connection.
type faults struct {
	Latency time.Duration // every chunk is forwarded this long after it was read
	Rate    int64         // bytes per second at most (0: no limit)
	// ResetP is the chance that a connection (open when the faults are
	// set, or new) is reset (RST on both sides) after a random 1–64 KiB
	// more forwarded.
	ResetP float64
	// ResetOpen resets every connection open when the faults are set,
	// after a random 1–64 KiB more forwarded (new ones as ResetP says).
	ResetOpen bool
	Stall     bool // forward nothing (connections stay open) until cleared
}

// proxy is a userspace TCP fault proxy: listeners (in any namespace) each
// forwarding to one target address dialled from the test's namespace.
type proxy struct {
	mu     sync.Mutex
	f      faults
	lns    []net.Listener
	conns  map[*pconn]struct{}
	closed bool
	wg     sync.WaitGroup

	accepted, resets atomic.Int64
	bytes            atomic.Int64
}

type pconn struct {
	a, b      *net.TCPConn
	resetAt   atomic.Int64 // reset once forwarded passes it (0: never)
	forwarded atomic.Int64
	dead      chan struct{}
	once      sync.Once
}

func newProxy() *proxy { return &proxy{conns: map[*pconn]struct{}{}} }

func (p *proxy) set(f faults) {
	p.mu.Lock()
	p.f = f
	for pc := range p.conns {
		pc.resetAt.Store(0)
		if f.ResetOpen {
			pc.resetAt.Store(pc.forwarded.Load() + 1024 + rand.Int64N(63*1024))
		} else {
			p.armReset(pc)
		}
	}
	p.mu.Unlock()
}

// armReset decides, under p.mu, whether pc is reset and after how much.
func (p *proxy) armReset(pc *pconn) {
	if p.f.ResetP > 0 && rand.Float64() < p.f.ResetP {
		pc.resetAt.Store(pc.forwarded.Load() + 1024 + rand.Int64N(63*1024))
	}
}

func (p *proxy) faults() faults {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.f
}

// serve forwards every connection ln accepts to target.
func (p *proxy) serve(ln net.Listener, target string) {
	p.mu.Lock()
	p.lns = append(p.lns, ln)
	p.mu.Unlock()
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			p.wg.Go(func() { p.handle(c.(*net.TCPConn), target) })
		}
	})
}

func (p *proxy) handle(a *net.TCPConn, target string) {
	d := net.Dialer{Timeout: 5 * time.Second}
	bc, err := d.Dial("tcp", target)
	if err != nil {
		a.SetLinger(0)
		a.Close()
		return
	}
	pc := &pconn{a: a, b: bc.(*net.TCPConn), dead: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		pc.reset()
		return
	}
	p.armReset(pc)
	p.conns[pc] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() { p.pipe(pc, pc.b, pc.a) })
	wg.Go(func() { p.pipe(pc, pc.a, pc.b) })
	wg.Wait()
	pc.a.Close()
	pc.b.Close()
	p.mu.Lock()
	delete(p.conns, pc)
	p.mu.Unlock()
}

// reset closes both sides with an RST.
func (pc *pconn) reset() {
	pc.once.Do(func() {
		close(pc.dead)
		pc.a.SetLinger(0)
		pc.b.SetLinger(0)
		pc.a.Close()
		pc.b.Close()
	})
}

type chunk struct {
	b   []byte
	due time.Time
}

// pipe forwards src to dst under the proxy's faults: a reader queues
// chunks with their due time, a writer forwards them when due and within
// the rate.
func (p *proxy) pipe(pc *pconn, dst, src *net.TCPConn) {
	q := make(chan chunk, 4096)
	var rerr error // the reader's end, read after q is closed
	go func() {
		defer close(q)
		for {
			buf := make([]byte, 16<<10)
			n, err := src.Read(buf)
			if n > 0 {
				q <- chunk{buf[:n], time.Now().Add(p.faults().Latency)}
			}
			if err != nil {
				rerr = err
				return
			}
		}
	}()
	var next time.Time // the rate limit's next free instant
	for c := range q {
		for p.faults().Stall && !pc.isDead() {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Until(c.due))
		if r := p.faults().Rate; r > 0 {
			now := time.Now()
			if next.Before(now) {
				next = now
			}
			next = next.Add(time.Duration(int64(len(c.b)) * int64(time.Second) / r))
			time.Sleep(time.Until(next))
		}
		if at := pc.resetAt.Load(); pc.forwarded.Add(int64(len(c.b))) > at && at > 0 {
			p.resets.Add(1)
			pc.reset()
		}
		if _, err := dst.Write(c.b); err != nil {
			pc.reset()
			for range q { // drain: the reader ends on its closed socket
			}
			return
		}
		p.bytes.Add(int64(len(c.b)))
	}
	// src ended: an orderly end is passed on as one, anything else resets.
	if pc.isDead() {
		return
	}
	if errors.Is(rerr, io.EOF) {
		dst.CloseWrite()
		return
	}
	pc.reset()
}

func (pc *pconn) isDead() bool {
	select {
	case <-pc.dead:
		return true
	default:
		return false
	}
}

// close stops the listeners and resets every connection.
func (p *proxy) close() {
	p.mu.Lock()
	p.closed = true
	for _, ln := range p.lns {
		ln.Close()
	}
	for pc := range p.conns {
		pc.reset()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
