package chaos

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
)

// buildKvxfer builds ./cmd/kvxfer with -tags chaos (and -race when race)
// into dir and returns the binary's path.
func buildKvxfer(t *testing.T, dir string, race bool) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	bin := filepath.Join(dir, "kvxfer")
	if race {
		bin += "-race"
	}
	args := []string{"build", "-tags", "chaos", "-o", bin}
	if race {
		args = append(args, "-race")
	}
	args = append(args, "../../cmd/kvxfer")
	start := time.Now()
	out, err := exec.Command(goBin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("built %s (race %v) in %v", bin, race, time.Since(start).Round(time.Millisecond))
	return bin
}

// freePort returns a loopback port below the ephemeral range that was
// free a moment ago (package freeport says why).
func freePort(t *testing.T) int {
	t.Helper()
	p, err := freeport.Port()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// proc is one kvxfer process, restartable.
type proc struct {
	name   string
	bin    string
	args   []string
	env    []string // added to this process's environment
	port   int      // its HTTP port
	tls    bool     // whether its HTTP API is mutual TLS
	logDir string

	mu       sync.Mutex
	cmd      *exec.Cmd
	gen      int           // incarnation
	exited   chan struct{} // of the current incarnation
	exitErr  error
	expected bool     // the current incarnation's exit is ours (SIGKILL, stop)
	crashes  []string // exits nobody asked for
	stopped  bool     // SIGSTOPped
}

func (p *proc) logPath(gen int) string {
	return filepath.Join(p.logDir, fmt.Sprintf("%s.%d.log", p.name, gen))
}

// start starts a new incarnation.
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gen++
	f, err := os.Create(p.logPath(p.gen))
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("%s: %v", p.name, err)
	}
	p.cmd, p.exited, p.expected, p.stopped = cmd, make(chan struct{}), false, false
	exited, gen := p.exited, p.gen
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		if !p.expected {
			p.crashes = append(p.crashes, fmt.Sprintf("%s (incarnation %d) exited by itself: %v", p.name, gen, err))
		}
		p.exitErr = err
		p.mu.Unlock()
		close(exited)
	}()
	return nil
}

// signal sends sig to the current incarnation; SIGKILL and SIGTERM mark
// its exit as expected.
func (p *proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if sig == syscall.SIGKILL || sig == syscall.SIGTERM {
		p.expected = true
	}
	switch sig {
	case syscall.SIGSTOP:
		p.stopped = true
	case syscall.SIGCONT:
		p.stopped = false
	}
	if p.cmd != nil && p.cmd.Process != nil {
		p.cmd.Process.Signal(sig)
	}
}

// kill SIGKILLs the current incarnation and waits for its exit.
func (p *proc) kill() {
	p.signal(syscall.SIGKILL)
	p.mu.Lock()
	ch := p.exited
	p.mu.Unlock()
	<-ch
}

// stop ends the process for good: SIGCONT (when stopped) and SIGTERM, then
// SIGKILL after a grace period.
func (p *proc) stop() {
	p.mu.Lock()
	ch := p.exited
	p.mu.Unlock()
	if ch == nil {
		return
	}
	select {
	case <-ch:
		return
	default:
	}
	p.signal(syscall.SIGCONT)
	p.signal(syscall.SIGTERM)
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		p.kill()
	}
}

func (p *proc) alive() bool {
	p.mu.Lock()
	ch := p.exited
	p.mu.Unlock()
	select {
	case <-ch:
		return false
	default:
		return true
	}
}

// logs returns every incarnation's output.
func (p *proc) logs() string {
	p.mu.Lock()
	n := p.gen
	p.mu.Unlock()
	var b strings.Builder
	for g := 1; g <= n; g++ {
		out, _ := os.ReadFile(p.logPath(g))
		b.Write(out)
	}
	return b.String()
}

// tail returns the last n bytes of the logs.
func (p *proc) tail(n int) string {
	s := p.logs()
	if len(s) > n {
		s = s[len(s)-n:]
	}
	return s
}

// clients: plain HTTP for the router and the reference worker, mutual TLS
// for the cluster's workers.
type clients struct {
	plain *http.Client
	tls   *http.Client
}

func newClients(t *testing.T, certDir string) clients {
	t.Helper()
	caPEM, err := os.ReadFile(filepath.Join(certDir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cert, err := tls.LoadX509KeyPair(filepath.Join(certDir, "harness.pem"), filepath.Join(certDir, "harness-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13},
		MaxIdleConnsPerHost: 4, IdleConnTimeout: 5 * time.Second}
	ptr := &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 5 * time.Second}
	c := clients{plain: &http.Client{Transport: ptr}, tls: &http.Client{Transport: tr}}
	t.Cleanup(func() { tr.CloseIdleConnections(); ptr.CloseIdleConnections() })
	return c
}

func (c clients) base(p *proc) (string, *http.Client) {
	if p.tls {
		return "https://127.0.0.1:" + strconv.Itoa(p.port), c.tls
	}
	return "http://127.0.0.1:" + strconv.Itoa(p.port), c.plain
}

// healthy reports whether p answers /health with 200 within d.
func (c clients) healthy(p *proc, d time.Duration) bool {
	base, hc := c.base(p)
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/health", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitHealthy waits until p is healthy, at most within.
func (c clients) waitHealthy(p *proc, within time.Duration) error {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if !p.alive() {
			return fmt.Errorf("%s exited while starting:\n%s", p.name, p.tail(2000))
		}
		if c.healthy(p, time.Second) {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s not healthy within %v:\n%s", p.name, within, p.tail(2000))
}

// procMetrics is what the harness reads from a process's /metrics.
type procMetrics struct {
	pinned  int // kvxfer_pool_blocks{state="pinned"}, summed over ranks
	openFDs int
}

func (c clients) metrics(p *proc) (procMetrics, error) {
	var m procMetrics
	base, hc := c.base(p)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return m, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return m, fmt.Errorf("%s /metrics: %s", p.name, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		name, val, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
		if err != nil {
			continue
		}
		switch {
		case strings.HasPrefix(name, "kvxfer_pool_blocks{") && strings.Contains(name, `state="pinned"`):
			m.pinned += int(v)
		case name == "process_open_fds":
			m.openFDs = int(v)
		}
	}
	return m, sc.Err()
}

// proxy is a userspace TCP proxy in front of a worker: the router talks to
// the worker through it, and it can cut live connections, flip bytes of
// the worker's answers, and stop listening (the worker's port closed).
type proxy struct {
	addr   string // where it listens
	target string

	mu      sync.Mutex
	ln      net.Listener
	conns   map[net.Conn]net.Conn // client side -> worker side
	corrupt int                   // bytes still to flip
	rng     *rng
	flipped chan struct{} // gets a value per flipped byte
	wg      sync.WaitGroup
}

func newProxy(t *testing.T, target string, seed uint64) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{addr: ln.Addr().String(), target: target, ln: ln, conns: map[net.Conn]net.Conn{}, rng: newRng(seed), flipped: make(chan struct{}, 1024)}
	p.wg.Add(1)
	go p.serve(ln)
	return p
}

func (p *proxy) serve(ln net.Listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		w, err := net.DialTimeout("tcp", p.target, 2*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c] = w
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); p.pipe(w, c, false) }()
		go func() { defer p.wg.Done(); p.pipe(c, w, true) }()
	}
}

// pipe copies from src to dst; fromWorker says src is the worker (whose
// bytes the proxy may flip).
func (p *proxy) pipe(dst, src net.Conn, fromWorker bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if fromWorker {
				p.mu.Lock()
				if p.corrupt > 0 {
					p.corrupt--
					buf[p.rng.intn(n)] ^= byte(1 + p.rng.intn(255))
					select {
					case p.flipped <- struct{}{}:
					default:
					}
				}
				p.mu.Unlock()
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			break
		}
	}
	src.Close()
	dst.Close()
	p.mu.Lock()
	if fromWorker {
		delete(p.conns, dst)
	} else {
		delete(p.conns, src)
	}
	p.mu.Unlock()
}

// cut closes every live connection and returns how many.
func (p *proxy) cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c, w := range p.conns {
		c.Close()
		w.Close()
		n++
	}
	return n
}

// flip makes the proxy flip one byte in each of the next n reads from the
// worker.
func (p *proxy) flip(n int) {
	p.mu.Lock()
	p.corrupt = max(0, p.corrupt+n)
	p.mu.Unlock()
}

// pause closes the listener (new connections are refused); resume listens
// again on the same address.
func (p *proxy) pause() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
}

func (p *proxy) resume() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		return nil
	}
	var ln net.Listener
	var err error
	for range 50 { // the port may linger a moment
		if ln, err = net.Listen("tcp", p.addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	p.ln = ln
	p.wg.Add(1)
	go p.serve(ln)
	return nil
}

func (p *proxy) close() {
	p.pause()
	p.cut()
	p.wg.Wait()
}

// rng is a small deterministic generator (splitmix64); not safe for
// concurrent use.
type rng struct{ s uint64 }

func newRng(seed uint64) *rng { return &rng{s: seed} }

func (r *rng) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	z := r.s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (r *rng) intn(n int) int { return int(r.next() % uint64(n)) }

func (r *rng) duration(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(r.next()%uint64(hi-lo+1))
}
