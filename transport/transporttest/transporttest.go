package transporttest

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
)

// Limit bounds every wait of the suite: an operation that has not ended
// after Limit fails the test instead of hanging it. It detects hangs, not
// slowness: a 256 MiB transfer over TLS under -race on a loaded 2-core
// machine took more than 10 s.
const Limit = 30 * time.Second

// Run runs the suite. open returns two fresh transports of the backend under
// test, each able to send to the other; the suite closes both (Close is
// idempotent, so open may also close them in a t.Cleanup).
//
// Every case ends with goleak.VerifyNone, ignoring the goroutines that ran
// before it, so the cases run one at a time and the caller must not run
// other tests in parallel with Run.
func Run(t *testing.T, open func(t *testing.T) (a, b transport.Transport)) {
	RunOptions(t, open, Options{})
}

// Options adapt the suite to a backend.
type Options struct {
	// Alloc, when set, allocates the memory of the suite's sources (what
	// it passes to Send): n > 0 zeroed bytes and, for a backend that Sends
	// only from registered memory, the file behind them (nil: none). The
	// suite registers every source with each transport of its case that
	// implements transport.MemoryRegistrar (RegisterMemory(mem, f)), and
	// calls free once those transports have closed. nil: sources come from
	// make and are never registered.
	Alloc func(n int) (mem []byte, f *os.File, free func(), err error)

	// SkipLarge leaves out RoundTrip's largest case (256 MiB; 64 MiB
	// remains, as in the cancel cases). For a variant of a backend whose
	// plain suite runs it (other frame sizes, TLS, a wrapper) or a test
	// double: what the variant changes is exercised long before 64 MiB,
	// and the large case costs seconds under -race. A backend's plain
	// suite leaves it false.
	SkipLarge bool
}

// RunOptions runs the suite as Run does, adapted by opts.
func RunOptions(t *testing.T, open func(t *testing.T) (a, b transport.Transport), opts Options) {
	s := &suite{open: open, opts: opts, cases: make(map[*testing.T]*caseMem)}
	cases := []struct {
		name string
		fn   func(t *testing.T)
	}{
		{"RoundTrip", s.roundTrip},
		{"Scattered", s.scattered},
		{"ManyPieces", s.manyPieces},
		{"Concurrent", s.concurrent},
		{"ExpectEmpty", s.expectEmpty},
		{"CancelBeforeSend", s.cancelBeforeSend},
		{"CancelDuringReceive", s.cancelDuringReceive},
		{"SenderCancel", s.senderCancel},
		{"SenderDeadline", s.senderDeadline},
		{"CloseSenderWhileSending", s.closeSenderWhileSending},
		{"CloseReceiverWhileSending", s.closeReceiverWhileSending},
		{"SendToClosedPeer", s.sendToClosedPeer},
		{"BadDescriptor", s.badDescriptor},
		{"AfterClose", s.afterClose},
		{"UnknownTag", s.unknownTag},
	}
	for _, c := range cases {
		t.Run(c.name, c.fn)
	}
}

type suite struct {
	open func(t *testing.T) (a, b transport.Transport)
	opts Options

	mu    sync.Mutex
	cases map[*testing.T]*caseMem
}

// caseMem is what one (sub)test has opened and allocated, for Options.Alloc.
type caseMem struct {
	trs   []transport.Transport
	mems  []allocated
	frees []func()
}

type allocated struct {
	mem []byte
	f   *os.File
}

// caseOf returns the state of t, creating it (and arranging for its
// memory to be freed) on first use. Called before t's transports open, so
// that the cleanup that frees runs after theirs that close.
func (s *suite) caseOf(t *testing.T) *caseMem {
	s.mu.Lock()
	defer s.mu.Unlock()
	cm := s.cases[t]
	if cm == nil {
		cm = &caseMem{}
		s.cases[t] = cm
		t.Cleanup(func() {
			s.mu.Lock()
			delete(s.cases, t)
			s.mu.Unlock()
			for _, free := range cm.frees {
				free()
			}
		})
	}
	return cm
}

// register registers m with tr if tr is a transport.MemoryRegistrar; a
// transport that has closed may refuse.
func register(t *testing.T, tr transport.Transport, m allocated) {
	t.Helper()
	if mr, ok := tr.(transport.MemoryRegistrar); ok {
		if err := mr.RegisterMemory(m.mem, m.f); err != nil && !errors.Is(err, net.ErrClosed) {
			t.Fatalf("RegisterMemory(%d bytes): %v", len(m.mem), err)
		}
	}
}

// src returns n zeroed bytes for a source: from Options.Alloc, registered
// with every transport of t's case, or from make.
func (s *suite) src(t *testing.T, n int) []byte {
	t.Helper()
	if s.opts.Alloc == nil || n == 0 {
		return make([]byte, n)
	}
	mem, f, free, err := s.opts.Alloc(n)
	if err != nil {
		t.Fatalf("Options.Alloc(%d): %v", n, err)
	}
	cm := s.caseOf(t)
	m := allocated{mem: mem, f: f}
	s.mu.Lock()
	cm.frees = append(cm.frees, free)
	cm.mems = append(cm.mems, m)
	trs := cm.trs
	s.mu.Unlock()
	if len(mem) != n {
		t.Fatalf("Options.Alloc(%d) returned %d bytes", n, len(mem))
	}
	for _, tr := range trs {
		register(t, tr, m)
	}
	return mem
}

// srcSegments returns source pieces of the given sizes, cut from one
// allocation of s.src.
func (s *suite) srcSegments(t *testing.T, sizes []int) [][]byte {
	t.Helper()
	n := 0
	for _, v := range sizes {
		n += v
	}
	mem := s.src(t, n)
	out := make([][]byte, len(sizes))
	off := 0
	for i, v := range sizes {
		out[i] = mem[off : off+v : off+v]
		off += v
	}
	return out
}

// pair opens two transports for one case and arranges, in t.Cleanup, for
// both to close (within Limit) and then for a goroutine leak check.
func (s *suite) pair(t *testing.T) (a, b transport.Transport) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) }) // runs last
	cm := s.caseOf(t)
	a, b = s.open(t)
	s.mu.Lock()
	cm.trs = append(cm.trs, a, b)
	mems := cm.mems
	s.mu.Unlock()
	for _, m := range mems {
		register(t, a, m)
		register(t, b, m)
	}
	t.Cleanup(func() {
		closeWithin(t, a, "a")
		closeWithin(t, b, "b")
	})
	return a, b
}

// closeWithin closes tr, failing t if Close errs or takes longer than Limit.
func closeWithin(t *testing.T, tr transport.Transport, name string) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- tr.Close() }()
	timer := time.NewTimer(Limit)
	defer timer.Stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Close(%s): %v", name, err)
		}
	case <-timer.C:
		t.Errorf("Close(%s) still running after %v", name, Limit)
	}
}

// wait fails the test unless ch is closed within Limit.
func wait(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	timer := time.NewTimer(Limit)
	defer timer.Stop()
	select {
	case <-ch:
	case <-timer.C:
		t.Fatalf("%s: not done after %v", what, Limit)
	}
}

// result fails the test unless ch yields within Limit, and returns it.
func result(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	timer := time.NewTimer(Limit)
	defer timer.Stop()
	select {
	case err := <-ch:
		return err
	case <-timer.C:
		t.Fatalf("%s: not returned after %v", what, Limit)
		return nil
	}
}

// sendAsync runs tr.Send in a goroutine; started is closed just before it
// calls Send.
func sendAsync(ctx context.Context, tr transport.Transport, desc transport.Descriptor, src [][]byte) (res <-chan error, started <-chan struct{}) {
	ch := make(chan error, 1)
	st := make(chan struct{})
	go func() {
		close(st)
		ch <- tr.Send(ctx, desc, src)
	}()
	return ch, st
}

// send calls tr.Send bounded by Limit.
func send(t *testing.T, tr transport.Transport, desc transport.Descriptor, src [][]byte) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Limit)
	defer cancel()
	res, _ := sendAsync(ctx, tr, desc, src)
	return result(t, res, "Send")
}

// expect calls tr.Expect and fails the test on error.
func expect(t *testing.T, tr transport.Transport, dst [][]byte) transport.Recv {
	t.Helper()
	r, err := tr.Expect(dst)
	if err != nil {
		t.Fatalf("Expect(%d bytes): %v", total(dst), err)
	}
	if d := r.Descriptor(); len(d) == 0 || len(d) > transport.MaxDescriptorBytes {
		t.Fatalf("Expect: descriptor of %d bytes, want 1..%d", len(d), transport.MaxDescriptorBytes)
	}
	return r
}

// transfer moves src from one transport to the other into dst and checks
// every byte.
func transfer(t *testing.T, from, to transport.Transport, src, dst [][]byte) {
	t.Helper()
	r := expect(t, to, dst)
	if err := send(t, from, r.Descriptor(), src); err != nil {
		r.Cancel()
		t.Fatalf("Send(%d bytes): %v", total(src), err)
	}
	wait(t, r.Done(), "Recv")
	if err := r.Err(); err != nil {
		t.Fatalf("Recv(%d bytes): %v", total(dst), err)
	}
	if off, ok := equal(dst, src); !ok {
		t.Fatalf("Recv(%d bytes): first wrong byte at offset %d", total(dst), off)
	}
}

// roundTrip transfers one contiguous buffer of each size, both ways.
func (s *suite) roundTrip(t *testing.T) {
	sizes := []struct {
		name string
		n    int
	}{
		{"1B", 1}, {"4KiB+3", 4<<10 + 3}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20}, {"256MiB", 256 << 20},
	}
	for _, sz := range sizes {
		t.Run(sz.name, func(t *testing.T) {
			if sz.n > 64<<20 && testing.Short() {
				t.Skip("skipped in -short mode")
			}
			if sz.n > 64<<20 && s.opts.SkipLarge {
				t.Skip("Options.SkipLarge: a variant; the backend's plain suite runs this size")
			}
			a, b := s.pair(t)
			src := [][]byte{pattern(seed(t), 0, s.src(t, sz.n))}
			transfer(t, a, b, src, [][]byte{make([]byte, sz.n)})
			if sz.n <= 1<<20 {
				transfer(t, b, a, src, [][]byte{make([]byte, sz.n)})
			}
		})
	}
}

// scattered transfers between uneven, differently cut, segments (empty ones
// among them), several frames long.
func (s *suite) scattered(t *testing.T) {
	a, b := s.pair(t)
	srcSizes := []int{1, 7, 0, 4096, 65537, 3<<20 + 5, 13, 0, 1 << 20, 5<<20 - 3, 999}
	dstSizes := []int{4099, 0, 2<<20 + 1, 3, 1<<20 - 7, 0, 6 << 20}
	n := 0
	for _, v := range srcSizes {
		n += v
	}
	m := 0
	for _, v := range dstSizes[:len(dstSizes)-1] {
		m += v
	}
	dstSizes[len(dstSizes)-1] = n - m
	src := s.srcSegments(t, srcSizes)
	fill(seed(t), src)
	transfer(t, a, b, src, segments(dstSizes))
	transfer(t, b, a, src, segments(dstSizes))
}

// manyPieces transfers thousands of small pieces (more than a writev takes
// at once) into a few.
func (s *suite) manyPieces(t *testing.T) {
	a, b := s.pair(t)
	rng := rand.New(rand.NewPCG(seed(t), 1))
	sizes := make([]int, 5000)
	n := 0
	for i := range sizes {
		sizes[i] = rng.IntN(700)
		n += sizes[i]
	}
	src := s.srcSegments(t, sizes)
	fill(seed(t), src)
	transfer(t, a, b, src, segments([]int{n / 3, n - n/3}))
	flat := s.src(t, n)
	copy(flat, flatten(src))
	transfer(t, b, a, [][]byte{flat}, segments(sizes))
}

// concurrent runs 200 small and a few large transfers at once, both ways.
func (s *suite) concurrent(t *testing.T) {
	a, b := s.pair(t)
	const small, large = 200, 4
	rng := rand.New(rand.NewPCG(seed(t), 2))
	var wg sync.WaitGroup
	for i := range small + large {
		n := 1 + rng.IntN(64<<10)
		if i >= small {
			n = 8<<20 + rng.IntN(1<<20)
		}
		from, to := a, b
		if i%2 == 1 {
			from, to = b, a
		}
		src := [][]byte{pattern(seed(t)+uint64(i), 0, s.src(t, n))}
		wg.Go(func() {
			if err := transferQuiet(from, to, src); err != nil {
				t.Errorf("transfer %d (%d bytes): %v", i, n, err)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	wait(t, done, "concurrent transfers")
}

// transferQuiet is transfer for goroutines other than the test's: it
// returns what went wrong. Every wait is bounded by Limit.
func transferQuiet(from, to transport.Transport, src [][]byte) error {
	dst := [][]byte{make([]byte, total(src))}
	r, err := to.Expect(dst)
	if err != nil {
		return fmt.Errorf("expect: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), Limit)
	defer cancel()
	if err := from.Send(ctx, r.Descriptor(), src); err != nil {
		r.Cancel()
		return fmt.Errorf("send: %w", err)
	}
	select {
	case <-r.Done():
	case <-ctx.Done():
		r.Cancel()
		return fmt.Errorf("recv: not done after %v", Limit)
	}
	if err := r.Err(); err != nil {
		return fmt.Errorf("recv: %w", err)
	}
	if off, ok := equal(dst, src); !ok {
		return fmt.Errorf("first wrong byte at offset %d", off)
	}
	return nil
}

// expectEmpty: nothing to receive is an error.
func (s *suite) expectEmpty(t *testing.T) {
	a, _ := s.pair(t)
	for _, dst := range [][][]byte{nil, {}, {{}}, {{}, {}}} {
		if r, err := a.Expect(dst); err == nil {
			r.Cancel()
			t.Errorf("Expect(%d empty pieces) = nil error, want an error", len(dst))
		}
	}
}

// cancelBeforeSend: a receipt cancelled before its sender starts ends with
// ErrCanceled, its dst is never written, and the receiver stays healthy.
func (s *suite) cancelBeforeSend(t *testing.T) {
	a, b := s.pair(t)
	const n = 3<<20 + 1
	dst := [][]byte{make([]byte, n)}
	r := expect(t, b, dst)
	cancelWithin(t, r)
	wait(t, r.Done(), "Recv after Cancel")
	if err := r.Err(); !errors.Is(err, transport.ErrCanceled) {
		t.Fatalf("Recv.Err after Cancel = %v, want ErrCanceled", err)
	}
	cancelWithin(t, r) // idempotent
	canary(dst)
	_ = send(t, a, r.Descriptor(), [][]byte{pattern(seed(t), 0, s.src(t, n))}) // any result
	s.healthy(t, a, b)
	checkCanary(t, dst, "after Cancel")
}

// cancelDuringReceive: Cancel in the middle of a transfer returns promptly,
// and after it returns dst is not written.
func (s *suite) cancelDuringReceive(t *testing.T) {
	a, b := s.pair(t)
	const n = 64 << 20
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}
	dst := [][]byte{make([]byte, n)}
	for _, delay := range []time.Duration{0, time.Millisecond, 5 * time.Millisecond} {
		r := expect(t, b, dst)
		ctx, cancel := context.WithTimeout(context.Background(), Limit)
		res, started := sendAsync(ctx, a, r.Descriptor(), src)
		<-started
		time.Sleep(delay)
		cancelWithin(t, r)
		wait(t, r.Done(), "Recv after Cancel")
		if err := r.Err(); err != nil && !errors.Is(err, transport.ErrCanceled) {
			t.Errorf("delay %v: Recv.Err after Cancel = %v, want nil (done before) or ErrCanceled", delay, err)
		}
		canary(dst) // the caller owns dst again
		_ = result(t, res, "Send to a cancelled receipt")
		cancel()
		s.healthy(t, a, b)
		checkCanary(t, dst, fmt.Sprintf("delay %v: after Cancel", delay))
	}
}

// senderCancel: a Send whose ctx is cancelled, before or during the
// transfer, returns an error wrapping context.Canceled, and the receipt
// fails with ErrAborted (or ErrPeerLost).
func (s *suite) senderCancel(t *testing.T) {
	a, b := s.pair(t)
	const n = 64 << 20
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}
	dst := [][]byte{make([]byte, n)}

	r := expect(t, b, dst)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := result(t, first(sendAsync(ctx, a, r.Descriptor(), src)), "Send with a cancelled ctx")
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Send with a cancelled ctx = %v, want an error wrapping context.Canceled", err)
	}
	expectFailed(t, r, "Recv of a cancelled Send", transport.ErrAborted, transport.ErrPeerLost)

	for _, delay := range []time.Duration{time.Millisecond, 5 * time.Millisecond} {
		r := expect(t, b, dst)
		ctx, cancel := context.WithCancel(context.Background())
		res, started := sendAsync(ctx, a, r.Descriptor(), src)
		<-started
		time.Sleep(delay)
		cancel()
		err := result(t, res, "Send after cancel")
		if err == nil {
			t.Logf("delay %v: Send finished before its cancel", delay)
			wait(t, r.Done(), "Recv")
			if r.Err() != nil {
				t.Fatalf("delay %v: Send returned nil but Recv failed: %v", delay, r.Err())
			}
			continue
		}
		if !errors.Is(err, context.Canceled) {
			t.Errorf("delay %v: Send = %v, want an error wrapping context.Canceled", delay, err)
		}
		expectFailed(t, r, "Recv of a cancelled Send", transport.ErrAborted, transport.ErrPeerLost)
	}
	s.healthy(t, a, b)
}

// senderDeadline: a Send past its deadline returns a timeout error.
func (s *suite) senderDeadline(t *testing.T) {
	a, b := s.pair(t)
	const n = 64 << 20
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}
	dst := [][]byte{make([]byte, n)}
	for _, d := range []time.Duration{-time.Second, time.Millisecond} {
		r := expect(t, b, dst)
		ctx, cancel := context.WithTimeout(context.Background(), d)
		err := result(t, first(sendAsync(ctx, a, r.Descriptor(), src)), "Send with a deadline")
		cancel()
		if err == nil {
			t.Logf("timeout %v: Send finished before its deadline", d)
			wait(t, r.Done(), "Recv")
			continue
		}
		var te *transport.TimeoutError
		if !errors.As(err, &te) || !te.Timeout() || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("timeout %v: Send = %v (%T), want a *transport.TimeoutError wrapping context.DeadlineExceeded", d, err, err)
		}
		var ne interface{ Timeout() bool }
		if !errors.As(err, &ne) || !ne.Timeout() {
			t.Errorf("timeout %v: Send error has no Timeout() true", d)
		}
		expectFailed(t, r, "Recv of a timed-out Send", transport.ErrAborted, transport.ErrPeerLost)
	}
	s.healthy(t, a, b)
}

// closeSenderWhileSending: Close of the sending transport in the middle of
// a Send makes it return, and the receipt fails.
func (s *suite) closeSenderWhileSending(t *testing.T) {
	a, b := s.pair(t)
	const n = 64 << 20
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}
	dst := [][]byte{make([]byte, n)}
	s.healthy(t, a, b) // connections up, so that the Send below starts at once
	r := expect(t, b, dst)
	res, started := sendAsync(context.Background(), a, r.Descriptor(), src)
	<-started
	time.Sleep(5 * time.Millisecond)
	closeWithin(t, a, "a")
	err := result(t, res, "Send while its transport closes")
	if err == nil {
		t.Log("Send finished before Close")
		wait(t, r.Done(), "Recv")
		if r.Err() != nil {
			t.Fatalf("Send returned nil but Recv failed: %v", r.Err())
		}
		return
	}
	t.Logf("Send: %v", err)
	expectFailed(t, r, "Recv from a closed sender", transport.ErrAborted, transport.ErrPeerLost)
}

// closeReceiverWhileSending: the receiver closes (its peer, as the sender
// sees it, dies) in the middle of a Send: the Send fails with ErrPeerLost and
// the receipt with net.ErrClosed.
func (s *suite) closeReceiverWhileSending(t *testing.T) {
	a, b := s.pair(t)
	const n = 64 << 20
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}
	dst := [][]byte{make([]byte, n)}
	s.healthy(t, a, b)
	r := expect(t, b, dst)
	res, started := sendAsync(context.Background(), a, r.Descriptor(), src)
	<-started
	time.Sleep(5 * time.Millisecond)
	closeWithin(t, b, "b")
	wait(t, r.Done(), "Recv on a closed transport")
	rerr := r.Err()
	if rerr != nil && !errors.Is(rerr, net.ErrClosed) {
		t.Errorf("Recv on a closed transport: %v, want an error wrapping net.ErrClosed", rerr)
	}
	err := result(t, res, "Send to a closed peer")
	switch {
	case err == nil && rerr != nil:
		// The last bytes were in the kernel's buffers when b closed.
		t.Log("Send finished, Recv was closed")
	case err == nil:
		t.Log("Send finished before Close")
	case !errors.Is(err, transport.ErrPeerLost):
		t.Errorf("Send to a closed peer = %v, want ErrPeerLost", err)
	}

	// The other way round: a receipt pending on a whose sender, b, is gone.
	a2, b2 := s.pair(t)
	s.healthy(t, b2, a2)
	r = expect(t, a2, dst)
	res, started = sendAsync(context.Background(), b2, r.Descriptor(), src)
	<-started
	time.Sleep(5 * time.Millisecond)
	closeWithin(t, b2, "b2")
	err = result(t, res, "Send while its transport closes")
	wait(t, r.Done(), "Recv from a closed peer")
	if err == nil {
		if r.Err() != nil {
			t.Fatalf("Send returned nil but Recv failed: %v", r.Err())
		}
		return
	}
	expectFailed(t, r, "Recv from a closed peer", transport.ErrAborted, transport.ErrPeerLost, net.ErrClosed)
}

// sendToClosedPeer: a Send to a transport that has closed fails with
// ErrPeerLost, promptly.
func (s *suite) sendToClosedPeer(t *testing.T) {
	a, b := s.pair(t)
	dst := [][]byte{make([]byte, 1<<20)}
	r := expect(t, b, dst)
	closeWithin(t, b, "b")
	err := send(t, a, r.Descriptor(), [][]byte{s.src(t, 1<<20)})
	if !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("Send to a closed peer = %v, want ErrPeerLost", err)
	}
}

// badDescriptor: anything the backend did not produce, or that does not
// match src, fails Send with ErrBadDescriptor.
func (s *suite) badDescriptor(t *testing.T) {
	a, b := s.pair(t)
	const n = 4096
	r := expect(t, b, [][]byte{make([]byte, n)})
	defer r.Cancel()
	good := r.Descriptor()
	src := [][]byte{s.src(t, n)}
	bad := map[string]transport.Descriptor{
		"nil":       nil,
		"empty":     {},
		"text":      transport.Descriptor("this is not a descriptor of any backend"),
		"0xff":      transport.Descriptor(bytes.Repeat([]byte{0xff}, 64)),
		"zeros":     make(transport.Descriptor, len(good)),
		"too long":  make(transport.Descriptor, transport.MaxDescriptorBytes+1),
		"extended":  append(append(transport.Descriptor{}, good...), 0),
		"doubled":   append(append(transport.Descriptor{}, good...), good...),
		"truncated": good[:len(good)-1],
	}
	for i := 1; i < len(good)-1; i++ {
		bad[fmt.Sprintf("prefix %d", i)] = good[:i]
	}
	for name, d := range bad {
		if err := send(t, a, d, src); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("Send(%s descriptor) = %v, want ErrBadDescriptor", name, err)
		}
	}
	for _, m := range []int{n - 1, n + 1, 1} {
		if err := send(t, a, good, [][]byte{s.src(t, m)}); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("Send(%d bytes to a receipt of %d) = %v, want ErrBadDescriptor", m, n, err)
		}
	}
	if err := send(t, a, good, nil); !errors.Is(err, transport.ErrBadDescriptor) {
		t.Errorf("Send(no bytes to a receipt of %d) = %v, want ErrBadDescriptor", n, err)
	}
	if err := r.Err(); err != nil {
		t.Errorf("receipt failed by bad Sends: %v", err)
	}
	s.healthy(t, a, b)
}

// afterClose: Expect and Send on a closed transport fail with net.ErrClosed
// (a *transport.ClosedError), a pending receipt fails likewise, and Close
// is idempotent.
func (s *suite) afterClose(t *testing.T) {
	a, b := s.pair(t)
	pending := expect(t, a, [][]byte{make([]byte, 100)})
	rb := expect(t, b, [][]byte{make([]byte, 100)})
	defer rb.Cancel()
	closeWithin(t, a, "a")
	closeWithin(t, a, "a (again)")
	wait(t, pending.Done(), "pending Recv after Close")
	if err := pending.Err(); !errors.Is(err, net.ErrClosed) {
		t.Errorf("pending Recv after Close: %v, want net.ErrClosed", err)
	}
	pending.Cancel() // after Done: a no-op
	var ce *transport.ClosedError
	if _, err := a.Expect([][]byte{make([]byte, 1)}); !errors.Is(err, net.ErrClosed) || !errors.As(err, &ce) {
		t.Errorf("Expect after Close = %v, want a *transport.ClosedError", err)
	}
	if err := send(t, a, rb.Descriptor(), [][]byte{s.src(t, 100)}); !errors.Is(err, net.ErrClosed) || !errors.As(err, &ce) {
		t.Errorf("Send after Close = %v, want a *transport.ClosedError", err)
	}
}

// unknownTag: data for a receipt that was cancelled, or that has
// completed, is dropped without touching its memory, and the receiver
// stays healthy.
func (s *suite) unknownTag(t *testing.T) {
	a, b := s.pair(t)
	const n = 9<<20 + 1
	src := [][]byte{pattern(seed(t), 0, s.src(t, n))}

	dst := [][]byte{make([]byte, n)}
	r := expect(t, b, dst)
	cancelWithin(t, r)
	canary(dst)
	for range 3 {
		_ = send(t, a, r.Descriptor(), src) // any result
	}
	s.healthy(t, a, b)

	dst2 := [][]byte{make([]byte, n)}
	r2 := expect(t, b, dst2)
	if err := send(t, a, r2.Descriptor(), src); err != nil {
		t.Fatalf("Send: %v", err)
	}
	wait(t, r2.Done(), "Recv")
	if r2.Err() != nil {
		t.Fatalf("Recv: %v", r2.Err())
	}
	canary(dst2)
	_ = send(t, a, r2.Descriptor(), src) // a receipt that is done: any result
	s.healthy(t, a, b)
	time.Sleep(20 * time.Millisecond) // give late bytes a chance to show
	checkCanary(t, dst, "after Cancel")
	checkCanary(t, dst2, "after Done")
}

// healthy checks that transfers both ways still work.
func (s *suite) healthy(t *testing.T, a, b transport.Transport) {
	t.Helper()
	for _, n := range []int{1, 5 << 20} {
		src := [][]byte{pattern(seed(t)+uint64(n), 0, s.src(t, n))}
		transfer(t, a, b, src, [][]byte{make([]byte, n)})
		transfer(t, b, a, src, [][]byte{make([]byte, n)})
	}
}

// cancelWithin calls r.Cancel, failing the test if it takes Limit.
func cancelWithin(t *testing.T, r transport.Recv) {
	t.Helper()
	done := make(chan struct{})
	go func() { r.Cancel(); close(done) }()
	wait(t, done, "Recv.Cancel")
}

// expectFailed waits for r and checks that it failed with one of want.
func expectFailed(t *testing.T, r transport.Recv, what string, want ...error) {
	t.Helper()
	wait(t, r.Done(), what)
	err := r.Err()
	for _, w := range want {
		if errors.Is(err, w) {
			return
		}
	}
	t.Errorf("%s: Err = %v, want one of %v", what, err, want)
}

func first(res <-chan error, _ <-chan struct{}) <-chan error { return res }

// seed derives a pattern seed from the test's name.
func seed(t *testing.T) uint64 {
	h := fnv.New64a()
	h.Write([]byte(t.Name()))
	return h.Sum64()
}

const (
	blockBytes = 1 << 20
	stampEvery = 4 << 10
)

var blocks sync.Map // seed -> []byte: a random block per seed

// pattern fills p with the bytes at [off, off+len(p)) of the pattern of
// seed, and returns p. The pattern repeats a random 1 MiB block, stamped
// every 4 KiB with the absolute offset, so that a misplaced range shows.
func pattern(sd, off uint64, p []byte) []byte {
	blk, ok := blocks.Load(sd)
	if !ok {
		b := make([]byte, blockBytes)
		rng := rand.New(rand.NewPCG(sd, sd^0x9e3779b97f4a7c15))
		for i := 0; i < len(b); i += 8 {
			binary.LittleEndian.PutUint64(b[i:], rng.Uint64())
		}
		blk, _ = blocks.LoadOrStore(sd, b)
	}
	block := blk.([]byte)
	for i := 0; i < len(p); {
		at := (off + uint64(i)) % blockBytes
		i += copy(p[i:], block[at:])
	}
	// Stamps: 8 bytes at every multiple of stampEvery, clipped to p.
	var st [8]byte
	for s := (off + stampEvery - 1) / stampEvery * stampEvery; s < off+uint64(len(p)); s += stampEvery {
		binary.LittleEndian.PutUint64(st[:], s^sd)
		copy(p[s-off:], st[:])
	}
	// A stamp that starts before p and ends inside it.
	if s := off / stampEvery * stampEvery; s < off && off-s < 8 {
		binary.LittleEndian.PutUint64(st[:], s^sd)
		copy(p, st[off-s:])
	}
	return p
}

// fill fills scattered pieces with the pattern of seed as one stream.
func fill(sd uint64, pieces [][]byte) {
	var off uint64
	for _, p := range pieces {
		pattern(sd, off, p)
		off += uint64(len(p))
	}
}

func segments(sizes []int) [][]byte {
	out := make([][]byte, len(sizes))
	for i, n := range sizes {
		out[i] = make([]byte, n)
	}
	return out
}

func flatten(pieces [][]byte) []byte {
	var out []byte
	for _, p := range pieces {
		out = append(out, p...)
	}
	return out
}

func total(pieces [][]byte) int64 {
	var n int64
	for _, p := range pieces {
		n += int64(len(p))
	}
	return n
}

// equal compares two scattered byte streams; on a difference it returns
// the offset of the first wrong byte.
func equal(got, want [][]byte) (int64, bool) {
	var off int64
	var g, w []byte
	for {
		for len(g) == 0 && len(got) > 0 {
			g, got = got[0], got[1:]
		}
		for len(w) == 0 && len(want) > 0 {
			w, want = want[0], want[1:]
		}
		if len(g) == 0 || len(w) == 0 {
			return off, len(g) == len(w)
		}
		k := min(len(g), len(w))
		if !bytes.Equal(g[:k], w[:k]) {
			for i := range k {
				if g[i] != w[i] {
					return off + int64(i), false
				}
			}
		}
		g, w, off = g[k:], w[k:], off+int64(k)
	}
}

const canaryByte = 0xa5

// canary fills dst with canaryByte.
func canary(dst [][]byte) {
	for _, p := range dst {
		if len(p) == 0 {
			continue
		}
		p[0] = canaryByte
		for i := 1; i < len(p); i *= 2 {
			copy(p[i:], p[:i])
		}
	}
}

// checkCanary fails the test if dst is not all canaryByte: the transport
// wrote into memory it no longer owned.
func checkCanary(t *testing.T, dst [][]byte, when string) {
	t.Helper()
	ref := make([]byte, 64<<10)
	canary([][]byte{ref})
	var off int64
	for _, p := range dst {
		for len(p) > 0 {
			k := min(len(p), len(ref))
			if !bytes.Equal(p[:k], ref[:k]) {
				i := 0
				for p[i] == canaryByte {
					i++
				}
				t.Errorf("%s: dst written at offset %d", when, off+int64(i))
				return
			}
			p, off = p[k:], off+int64(k)
		}
	}
}
