//go:build ucx && cgo

package ucx

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"

	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

// The test binary doubles as a peer process: with KVXFER_UCX_TEST_PEER=1
// it runs peerMain, driven over stdin/stdout, instead of the tests.
const peerEnv = "KVXFER_UCX_TEST_PEER"

func TestMain(m *testing.M) {
	if os.Getenv(peerEnv) == "1" {
		os.Exit(peerMain(os.Stdin, os.Stdout))
	}
	goleak.VerifyTestMain(m)
}

func open(t testing.TB) *Transport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr, err := Open(ctx, transport.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func openPair(t *testing.T) (a, b transport.Transport) {
	t.Helper()
	return open(t), open(t)
}

// TestConformance runs the suite over the transports UCX picks by itself
// (on one host: shared memory, sysv/posix and cma).
func TestConformance(t *testing.T) {
	transporttest.Run(t, openPair)
}

// TestConformanceTCP runs the suite with UCX_TLS=tcp, which UCX reads when
// each context is created. The backend's code is TestConformance's: the
// large round trip is left to it (and TestPeerKilled moves 256 and 512 MiB
// over tcp).
func TestConformanceTCP(t *testing.T) {
	t.Setenv("UCX_TLS", "tcp")
	transporttest.RunOptions(t, openPair, transporttest.Options{SkipLarge: true})
}

// roundTrip moves n bytes from a to b and checks them.
func roundTrip(t *testing.T, a, b transport.Transport, n int) {
	t.Helper()
	src := fillPattern(uint64(n), make([]byte, n))
	dst := make([]byte, n)
	r, err := b.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
	defer cancel()
	if err := a.Send(ctx, r.Descriptor(), [][]byte{src}); err != nil {
		r.Cancel()
		t.Fatalf("Send: %v", err)
	}
	select {
	case <-r.Done():
	case <-ctx.Done():
		r.Cancel()
		t.Fatal("Recv not done")
	}
	if err := r.Err(); err != nil {
		t.Fatalf("Recv: %v", err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("bytes differ")
	}
}

// TestName: Name reports the transports UCX really selected.
func TestName(t *testing.T) {
	tests := []struct {
		tls  string
		want func(tls []string) bool
		what string
	}{
		{"", func(tls []string) bool {
			return len(tls) > 0 && !contains(tls, "tcp") && (contains(tls, "sysv") || contains(tls, "posix"))
		}, "shared memory (sysv or posix), no tcp"},
		{"tcp", func(tls []string) bool { return len(tls) == 1 && tls[0] == "tcp" }, "tcp only"},
	}
	for _, tt := range tests {
		t.Run("UCX_TLS="+tt.tls, func(t *testing.T) {
			if tt.tls != "" {
				t.Setenv("UCX_TLS", tt.tls)
			} else if v, ok := os.LookupEnv("UCX_TLS"); ok {
				t.Skipf("UCX_TLS=%s in the environment", v)
			}
			a, b := open(t), open(t)
			defer a.Close()
			defer b.Close()
			if a.Name() != "ucx" {
				t.Errorf("Name before any endpoint = %q, want ucx", a.Name())
			}
			roundTrip(t, a, b, 1<<20)
			tls := a.PeerTransports(b.Endpoint())
			t.Logf("a: %s, b: %s, a->b lanes %v", a.Name(), b.Name(), tls)
			if !tt.want(tls) {
				t.Errorf("a->b uses %v, want %s", tls, tt.what)
			}
			if want := "ucx(" + strings.Join(tls, ",") + ")"; a.Name() != want {
				t.Errorf("Name = %q, want %q", a.Name(), want)
			}
			if b.Name() == "ucx" {
				t.Errorf("receiver's Name = %q: it connected back, it should know", b.Name())
			}
			// The flag that decides whether the progress goroutine spins
			// follows the live endpoints: set with a tcp lane, cleared once
			// the peer is gone (b's goodbye).
			overTCP := func() bool { return onLoop(t, a, func(l *loop) bool { return l.overTCP() }) }
			if got := overTCP(); got != contains(tls, "tcp") {
				t.Errorf("overTCP = %v with lanes %v", got, tls)
			}
			b.Close()
			for deadline := time.Now().Add(transporttest.Limit); overTCP() && time.Now().Before(deadline); {
				time.Sleep(10 * time.Millisecond)
			}
			if overTCP() {
				t.Errorf("overTCP still set after the only peer closed")
			}
		})
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestEndpointFits: the worker address fits a descriptor with room to
// spare.
func TestEndpointFits(t *testing.T) {
	a := open(t)
	defer a.Close()
	raw, err := base64.StdEncoding.DecodeString(a.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.Expect([][]byte{make([]byte, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Cancel()
	t.Logf("endpoint %d bytes raw (%d base64), descriptor %d bytes", len(raw), len(a.Endpoint()), len(r.Descriptor()))
	if len(r.Descriptor()) > transport.MaxDescriptorBytes/2 {
		t.Errorf("descriptor of %d bytes: little room left below %d", len(r.Descriptor()), transport.MaxDescriptorBytes)
	}
}

// TestKVBlocks: 256 KV blocks, differently cut on each side, one message
// per receiver block (zero-copy rendezvous each), both ways.
func TestKVBlocks(t *testing.T) {
	a, b := open(t), open(t)
	defer a.Close()
	defer b.Close()
	const blocks, block = 256, 512 << 10
	src := make([][]byte, blocks)
	for i := range src {
		src[i] = fillPattern(uint64(i), make([]byte, block))
	}
	dst := make([][]byte, blocks*2)
	for i := range dst {
		dst[i] = make([]byte, block/2)
	}
	r, err := b.Expect(dst)
	if err != nil {
		t.Fatal(err)
	}
	d, err := decodeDescriptor(r.Descriptor())
	if err != nil {
		t.Fatal(err)
	}
	if len(d.groups) != blocks*2 {
		t.Errorf("%d messages for %d blocks of %d bytes", len(d.groups), len(dst), block/2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
	defer cancel()
	if err := a.Send(ctx, r.Descriptor(), src); err != nil {
		t.Fatal(err)
	}
	<-r.Done()
	if r.Err() != nil {
		t.Fatal(r.Err())
	}
	if !bytes.Equal(bytes.Join(dst, nil), bytes.Join(src, nil)) {
		t.Fatal("bytes differ")
	}
}

// TestCancelBothSides: receivers and senders cancelled at random moments
// of many-message transfers: a cancelled receipt's memory is never written
// after Cancel returns, a Send that reports an error leaves a failed
// receipt, one that reports success a complete one, and the pair stays
// healthy.
func TestCancelBothSides(t *testing.T) {
	for _, tls := range []string{"", "tcp"} {
		t.Run("UCX_TLS="+tls, func(t *testing.T) {
			if tls != "" {
				t.Setenv("UCX_TLS", tls)
			}
			a, b := open(t), open(t)
			defer a.Close()
			defer b.Close()
			rng := rand.New(rand.NewPCG(1, 2))
			const blocks, block = 64, 512 << 10
			canaryBlock := bytes.Repeat([]byte{0xa5}, block)
			src := make([][]byte, blocks)
			for i := range src {
				src[i] = fillPattern(uint64(i), make([]byte, block))
			}
			for i := range 30 {
				dst := make([][]byte, blocks)
				for j := range dst {
					dst[j] = make([]byte, block)
				}
				r, err := b.Expect(dst)
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				res := make(chan error, 1)
				go func() { res <- a.Send(ctx, r.Descriptor(), src) }()
				time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
				side := "receiver"
				if i%2 == 0 {
					side = "sender"
					cancel()
				} else {
					r.Cancel()
					for _, p := range dst {
						copy(p, canaryBlock)
					}
				}
				var err2 error
				select {
				case err2 = <-res:
				case <-time.After(transporttest.Limit):
					t.Fatalf("%d (%s): Send did not return", i, side)
				}
				cancel()
				select {
				case <-r.Done():
				case <-time.After(transporttest.Limit):
					t.Fatalf("%d (%s): Recv not done", i, side)
				}
				switch side {
				case "sender":
					if err2 == nil && r.Err() != nil {
						t.Fatalf("%d: Send nil but Recv %v", i, r.Err())
					}
					if err2 != nil && !errors.Is(err2, context.Canceled) {
						t.Fatalf("%d: Send = %v, want context.Canceled", i, err2)
					}
					if err2 != nil && !errors.Is(r.Err(), transport.ErrAborted) {
						t.Fatalf("%d: Send = %v but Recv = %v, want ErrAborted", i, err2, r.Err())
					}
				case "receiver":
					if err := r.Err(); err != nil && !errors.Is(err, transport.ErrCanceled) {
						t.Fatalf("%d: Recv after Cancel = %v", i, err)
					}
					if err2 != nil {
						t.Fatalf("%d: Send to a cancelled receipt = %v (its messages are dropped, it succeeds)", i, err2)
					}
					time.Sleep(time.Millisecond)
					for j, p := range dst {
						if !bytes.Equal(p, canaryBlock) {
							t.Fatalf("%d: dst[%d] written after Cancel returned", i, j)
						}
					}
				}
			}
			roundTrip(t, a, b, 5<<20)
			roundTrip(t, b, a, 5<<20)
			// Every aborted Send has ended: the count that gates the
			// abort timers is back to zero.
			if n := onLoop(t, a, func(l *loop) int { return l.aborting }); n != 0 {
				t.Errorf("%d sends still counted as aborting", n)
			}
		})
	}
}

// onLoop runs f on tr's progress goroutine and returns its result.
func onLoop[T any](t testing.TB, tr *Transport, f func(*loop) T) T {
	t.Helper()
	ch := make(chan T, 1)
	if !tr.submit(func() { ch <- f(tr.lp) }) {
		t.Fatal("the progress goroutine is gone")
	}
	return <-ch
}

// TestIdleDoesNotSpin: an idle transport sleeps in poll on UCX's event fd.
func TestIdleDoesNotSpin(t *testing.T) {
	a, b := open(t), open(t)
	defer a.Close()
	defer b.Close()
	roundTrip(t, a, b, 1<<20) // with endpoints, keepalive and all
	time.Sleep(100 * time.Millisecond)
	before := cpuTime(t)
	const wall = time.Second
	time.Sleep(wall)
	used := cpuTime(t) - before
	t.Logf("two idle transports used %v of CPU in %v", used, wall)
	if used > wall/10 {
		t.Errorf("idle transports used %v of CPU in %v", used, wall)
	}
}

func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// ---- a peer in another process -------------------------------------------

// peerMain serves commands, one a line, answering one line each:
//
//	recv N       -> "desc <base64>", later "got ok <fnv64a>" or "got err <text>"
//	send D N S   -> "sending", then "sent ok" or "sent err <text>" (N bytes
//	                of pattern S, zeros for 0, to descriptor D)
//	sink N M [S] -> "desc <base64>" for one N-byte receipt after another,
//	                into memory M ("thp" or "goheap", see alloc), cut into
//	                segments of S bytes when S is given
//	stop         -> exits
func peerMain(in io.Reader, out io.Writer) int {
	tr, err := Open(context.Background(), transport.Options{})
	if err != nil {
		fmt.Fprintln(out, "err", err)
		return 1
	}
	defer tr.Close()
	w := &lineWriter{w: out}
	w.println("ep", tr.Endpoint())
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 64<<10), 64<<10)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "recv":
			n, _ := strconv.Atoi(f[1])
			dst := make([]byte, n)
			r, err := tr.Expect([][]byte{dst})
			if err != nil {
				w.println("got err", err)
				continue
			}
			w.println("desc", base64.StdEncoding.EncodeToString(r.Descriptor()))
			go func() {
				<-r.Done()
				if r.Err() != nil {
					w.println("got err", r.Err())
					return
				}
				h := fnv.New64a()
				h.Write(dst)
				w.println("got ok", h.Sum64())
			}()
		case "send":
			desc, _ := base64.StdEncoding.DecodeString(f[1])
			n, _ := strconv.Atoi(f[2])
			seed, _ := strconv.ParseUint(f[3], 10, 64)
			src := make([]byte, n)
			if seed != 0 {
				fillPattern(seed, src)
			}
			w.println("sending")
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := tr.Send(ctx, desc, [][]byte{src}); err != nil {
					w.println("sent err", err)
					return
				}
				w.println("sent ok")
			}()
		case "sink":
			// Receive N-byte messages into one buffer, one after another,
			// until stdin closes: "desc" for each.
			n, _ := strconv.Atoi(f[1])
			var dst []byte
			if len(f) > 2 && f[2] == "goheap" {
				dst = make([]byte, n)
			} else {
				dst, err = syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
				if err != nil {
					w.println("got err", err)
					continue
				}
				syscall.Madvise(dst, 14) // MADV_HUGEPAGE
			}
			clear(dst)
			segs := [][]byte{dst}
			if len(f) > 3 {
				seg, _ := strconv.Atoi(f[3])
				segs = cut(dst, seg)
			}
			go func() {
				for {
					r, err := tr.Expect(segs)
					if err != nil {
						w.println("got err", err)
						return
					}
					w.println("desc", base64.StdEncoding.EncodeToString(r.Descriptor()))
					<-r.Done()
					if r.Err() != nil {
						w.println("got err", r.Err())
						return
					}
				}
			}()
		case "stop":
			return 0
		}
	}
	return 0
}

// cut returns b as segments of n bytes (the last shorter), or b whole
// when n is not positive.
func cut(b []byte, n int) [][]byte {
	if n <= 0 {
		return [][]byte{b}
	}
	var out [][]byte
	for len(b) > 0 {
		k := min(n, len(b))
		out = append(out, b[:k:k])
		b = b[k:]
	}
	return out
}

type lineWriter struct {
	mu chan struct{}
	w  io.Writer
}

func (l *lineWriter) println(a ...any) {
	if l.mu == nil {
		l.mu = make(chan struct{}, 1)
	}
	l.mu <- struct{}{}
	fmt.Fprintln(l.w, a...)
	<-l.mu
}

// peerProc is a running peer process.
type peerProc struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	ep    string
}

func startPeer(t testing.TB, env ...string) *peerProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), peerEnv+"=1"), env...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &peerProc{cmd: cmd, in: in, lines: make(chan string, 16)}
	go func() {
		defer close(p.lines)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 64<<10)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		in.Close()
		cmd.Process.Kill()
		cmd.Wait()          // an error after kill: already reaped
		for range p.lines { // the reader goroutine ends with the pipe
		}
	})
	p.ep = strings.TrimPrefix(p.expect(t, "ep "), "ep ")
	return p
}

// kill kills the peer and reaps it: UCX's shared-memory keepalive checks
// that the peer's process exists, which a zombie still does.
func (p *peerProc) kill() {
	p.cmd.Process.Kill()
	p.cmd.Process.Wait()
}

func (p *peerProc) cmdf(t testing.TB, format string, a ...any) {
	t.Helper()
	if _, err := fmt.Fprintf(p.in, format+"\n", a...); err != nil {
		t.Fatal(err)
	}
}

// expect returns the peer's next line, which must start with prefix.
func (p *peerProc) expect(t testing.TB, prefix string) string {
	t.Helper()
	select {
	case l, ok := <-p.lines:
		if !ok {
			t.Fatalf("peer exited, waiting for %q", prefix)
		}
		if !strings.HasPrefix(l, prefix) {
			t.Fatalf("peer said %q, want %q...", l, prefix)
		}
		return l
	case <-time.After(30 * time.Second):
		t.Fatalf("peer silent, waiting for %q", prefix)
		return ""
	}
}

// TestCrossProcess: transfers both ways between this process and another,
// with the default transports and with UCX_TLS=tcp, also with both sides'
// tcp receive buffers set by the environment to UCX's default (64 KiB, not
// the backend's 1 MiB).
func TestCrossProcess(t *testing.T) {
	for _, c := range []struct {
		name, tls string
		peerEnv   []string // and this process's
	}{
		{"UCX_TLS=", "", nil},
		{"UCX_TLS=tcp", "tcp", nil},
		{"UCX_TLS=tcp/rx_64K", "tcp", []string{"UCX_TCP_RX_SEG_SIZE=64K"}},
	} {
		tls := c.tls
		t.Run(c.name, func(t *testing.T) {
			env := c.peerEnv
			for _, kv := range c.peerEnv { // the same on this side
				k, v, _ := strings.Cut(kv, "=")
				t.Setenv(k, v)
			}
			if tls != "" {
				t.Setenv("UCX_TLS", tls)
				env = append(env, "UCX_TLS="+tls)
			}
			p := startPeer(t, env...)
			a := open(t)
			defer a.Close()
			for _, n := range []int{1, 100 << 10, 64 << 20} {
				// this -> peer
				p.cmdf(t, "recv %d", n)
				desc, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(p.expect(t, "desc "), "desc "))
				src := fillPattern(7, make([]byte, n))
				ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
				if err := a.Send(ctx, desc, [][]byte{src}); err != nil {
					cancel()
					t.Fatalf("Send %d to the peer: %v", n, err)
				}
				cancel()
				h := fnv.New64a()
				h.Write(src)
				if got, want := p.expect(t, "got "), fmt.Sprint("got ok ", h.Sum64()); got != want {
					t.Fatalf("peer: %q, want %q", got, want)
				}
				// peer -> this
				dst := make([]byte, n)
				r, err := a.Expect([][]byte{dst})
				if err != nil {
					t.Fatal(err)
				}
				p.cmdf(t, "send %s %d %d", base64.StdEncoding.EncodeToString(r.Descriptor()), n, 9)
				p.expect(t, "sending")
				if l := p.expect(t, "sent "); l != "sent ok" {
					t.Fatalf("peer: %s", l)
				}
				<-r.Done()
				if r.Err() != nil || !bytes.Equal(dst, fillPattern(9, make([]byte, n))) {
					t.Fatalf("Recv %d from the peer: %v (or bytes differ)", n, r.Err())
				}
			}
			t.Logf("this process: %s", a.Name())
			if tls == "tcp" && a.Name() != "ucx(tcp)" {
				t.Errorf("Name = %s, want ucx(tcp)", a.Name())
			}
			p.cmdf(t, "stop")
		})
	}
}

// TestPeerKilled: the other process dies (SIGKILL) in the middle of a
// transfer; the local side ends without hanging: a Send fails with
// ErrPeerLost (UCX's keepalive or the socket tells), a receipt fails with
// ErrPeerLost or is ended by the caller's deadline (Cancel).
func TestPeerKilled(t *testing.T) {
	for _, tls := range []string{"", "tcp"} {
		t.Run("UCX_TLS="+tls+"/sender-side", func(t *testing.T) {
			var env []string
			if tls != "" {
				t.Setenv("UCX_TLS", tls)
				env = append(env, "UCX_TLS="+tls)
			}
			p := startPeer(t, env...)
			a := open(t)
			defer a.Close()
			roundTripPeer(t, a, p) // connected both ways
			const n = 256 << 20
			p.cmdf(t, "recv %d", n)
			desc, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(p.expect(t, "desc "), "desc "))
			// Freeze the receiver so that the transfer is surely in flight,
			// then kill it.
			p.cmd.Process.Signal(syscall.SIGSTOP)
			res := make(chan error, 1)
			go func() { res <- a.Send(context.Background(), desc, [][]byte{make([]byte, n)}) }()
			time.Sleep(200 * time.Millisecond)
			p.kill()
			t0 := time.Now()
			select {
			case err := <-res:
				t.Logf("Send after %v: %v", time.Since(t0).Round(time.Millisecond), err)
				if !errors.Is(err, transport.ErrPeerLost) {
					t.Fatalf("Send to a killed peer = %v, want ErrPeerLost", err)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("Send to a killed peer did not return in 15s")
			}
		})
		t.Run("UCX_TLS="+tls+"/receiver-side", func(t *testing.T) {
			var env []string
			if tls != "" {
				t.Setenv("UCX_TLS", tls)
				env = append(env, "UCX_TLS="+tls)
			}
			p := startPeer(t, env...)
			a := open(t)
			defer a.Close()
			roundTripPeer(t, a, p)
			const n = 512 << 20
			dst := make([]byte, n)
			r, err := a.Expect([][]byte{dst})
			if err != nil {
				t.Fatal(err)
			}
			// A pattern, not zeros (seed 0), which dst holds already.
			const seed = 3
			p.cmdf(t, "send %s %d %d", base64.StdEncoding.EncodeToString(r.Descriptor()), n, seed)
			p.expect(t, "sending")
			time.Sleep(20 * time.Millisecond) // the transfer takes 80 ms or more
			p.kill()
			t0 := time.Now()
			select {
			case <-r.Done():
				t.Logf("Recv after %v: %v", time.Since(t0).Round(time.Millisecond), r.Err())
				switch err := r.Err(); {
				case err == nil:
					// The data got out before the kill: it must be whole.
					if i := firstDiff(dst, seed); i >= 0 {
						t.Fatalf("Recv from a killed peer succeeded, but byte %d of %d differs from what was sent", i, n)
					}
				case !errors.Is(err, transport.ErrPeerLost):
					t.Fatalf("Recv from a killed peer = %v, want ErrPeerLost (or nil with every byte)", err)
				}
			case <-time.After(5 * time.Second):
				// The caller's deadline (doc.go: a receipt whose sender died
				// before its messages arrived is bound to nobody): Cancel
				// must return, promptly, and end the receipt.
				done := make(chan struct{})
				go func() { r.Cancel(); close(done) }()
				select {
				case <-done:
					t.Logf("Recv not ended by UCX in 5s; Cancel returned: %v", r.Err())
					if err := r.Err(); !errors.Is(err, transport.ErrCanceled) && !errors.Is(err, transport.ErrPeerLost) {
						t.Fatalf("receipt after Cancel = %v, want ErrCanceled (or ErrPeerLost, had UCX just told)", err)
					}
				case <-time.After(15 * time.Second):
					t.Fatal("Cancel of a receipt from a killed peer did not return in 15s")
				}
			}
			// The transport still works, with a new peer.
			roundTripPeer(t, a, startPeer(t, env...))
		})
	}
}

// roundTripPeer moves a small message each way between a and p.
func roundTripPeer(t *testing.T, a *Transport, p *peerProc) {
	t.Helper()
	p.cmdf(t, "recv %d", 1000)
	desc, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(p.expect(t, "desc "), "desc "))
	ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
	defer cancel()
	if err := a.Send(ctx, desc, [][]byte{fillPattern(1, make([]byte, 1000))}); err != nil {
		t.Fatal(err)
	}
	p.expect(t, "got ok")
	dst := make([]byte, 1000)
	r, err := a.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	p.cmdf(t, "send %s %d %d", base64.StdEncoding.EncodeToString(r.Descriptor()), 1000, 2)
	p.expect(t, "sending")
	p.expect(t, "sent ok")
	<-r.Done()
	if r.Err() != nil {
		t.Fatal(r.Err())
	}
}

// pattern is the generator of fillPattern: a word per 8 bytes, little
// endian.
type pattern uint64

func newPattern(seed uint64) pattern { return pattern(seed*0x9e3779b97f4a7c15 + 1) }

func (x *pattern) next() uint64 {
	*x ^= *x << 13
	*x ^= *x >> 7
	*x ^= *x << 17
	return uint64(*x)
}

// fillPattern fills p with bytes from seed (the same in every process).
// Whole words are stored as words: under -race a copy per 8 bytes made
// the 512 MiB of TestPeerKilled take 16 s to fill, 6 s so.
func fillPattern(seed uint64, p []byte) []byte {
	x := newPattern(seed)
	i := 0
	for ; i+8 <= len(p); i += 8 {
		binary.LittleEndian.PutUint64(p[i:i+8], x.next())
	}
	if i < len(p) {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], x.next())
		copy(p[i:], b[:])
	}
	return p
}

// firstDiff returns the index of the first byte of p that differs from
// fillPattern(seed), or -1, without a second copy of p.
func firstDiff(p []byte, seed uint64) int {
	x := newPattern(seed)
	for i := 0; i < len(p); i += 8 {
		var b [8]byte
		w := x.next()
		if i+8 <= len(p) && binary.LittleEndian.Uint64(p[i:i+8]) == w {
			continue
		}
		binary.LittleEndian.PutUint64(b[:], w)
		for j, c := range b[:min(8, len(p)-i)] {
			if p[i+j] != c {
				return i + j
			}
		}
	}
	return -1
}

func TestFirstDiff(t *testing.T) {
	p := fillPattern(3, make([]byte, 1003))
	if i := firstDiff(p, 3); i != -1 {
		t.Fatalf("firstDiff of the pattern itself = %d", i)
	}
	for _, at := range []int{1001, 996, 3, 0} { // the tail, a whole word's last byte, the first word
		p[at]++
		if i := firstDiff(p, 3); i != at {
			t.Fatalf("firstDiff = %d, want %d", i, at)
		}
		p[at]--
	}
}

// TestFillPatternBytes pins fillPattern's bytes (the peer process and
// this one must agree; so must an old and a new test binary): the
// xorshift words of newPattern, little endian, the last one cut short.
func TestFillPatternBytes(t *testing.T) {
	want := func(seed uint64, n int) []byte {
		x := uint64(newPattern(seed))
		var out []byte
		for len(out) < n {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			out = binary.LittleEndian.AppendUint64(out, x)
		}
		return out[:n]
	}
	for _, n := range []int{0, 1, 7, 8, 9, 1000, 4099} {
		if got := fillPattern(5, make([]byte, n)); !bytes.Equal(got, want(5, n)) {
			t.Errorf("fillPattern(5, %d bytes) differs from the xorshift words", n)
		}
	}
}
