//go:build linux

package shm

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/transport"
)

// TestIdleConnectionsClosed: local connections that said HELLO and
// announced a correct window and then carry nothing, stop inside an op,
// or stop inside a message, are closed at the idle timeout and give their
// places back (a new sender is refused while they hold MaxConns and
// served after); a sender that keeps the receiver busy, with its socket
// silent or not, is kept past it, and every one of its Sends succeeds.
func TestIdleConnectionsClosed(t *testing.T) {
	const idle = 200 * time.Millisecond
	b := open(t, transport.Options{IdleTimeout: idle, MaxConns: 4})
	a := open(t, transport.Options{IdleTimeout: idle})
	// The busy sender takes its place first.
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 1)}, [][]byte{make([]byte, 4096)})

	silent, _ := rawConn(t, b)
	announce(t, silent, testArena(t, 64<<10), 16<<10, 4)

	// An op of two parts for an armed receipt, the second never posted.
	midOp, _ := rawConn(t, b)
	arena := testArena(t, 64<<10)
	announce(t, midOp, arena, 16<<10, 4)
	dst := make([]byte, 32<<10)
	r, err := b.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	first := readOf(0, 0, 16<<10, 32<<10, false)
	first.tag = tagOf(t, r)
	writeMsgs(t, midOp, first)

	// A message cut short: 3 bytes of a POST.
	midMsg, _ := rawConn(t, b)
	announce(t, midMsg, testArena(t, 64<<10), 16<<10, 4)
	if _, err := midMsg.Write(appendMsg(nil, &msg{typ: msgPost})[:3]); err != nil {
		t.Fatal(err)
	}
	eventually(t, "4 connections accepted", func() bool { return inbound(b) == 4 })

	// A fifth sender is refused while the four hold every place.
	c := open(t, transport.Options{IdleTimeout: idle})
	if err := trySend(c, b, 100); !errors.Is(err, transport.ErrPeerLost) {
		t.Fatalf("Send with every place held = %v, want ErrPeerLost (refused)", err)
	}

	// The busy sender sends back to back for 3 idle timeouts.
	start := time.Now()
	src := fill(make([]byte, 256<<10), 2)
	for n := 0; time.Since(start) < 3*idle; n++ {
		if err := trySend(a, b, len(src)); err != nil {
			t.Fatalf("Send %d of a busy sender, %v after the start: %v", n, time.Since(start), err)
		}
	}
	for _, k := range []struct {
		name string
		nc   *net.UnixConn
	}{{"silent after its window", silent}, {"stalled inside an op", midOp}, {"stalled inside a message", midMsg}} {
		if !closedWithin(k.nc, 2*time.Second) {
			t.Errorf("a connection %s was kept past the idle timeout (%v)", k.name, idle)
		}
	}
	within(t, 2*time.Second, "the stalled op's receipt", func() { <-r.Done() })
	if err := r.Err(); !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("the receipt of a stalled op: %v, want ErrPeerLost", err)
	}
	eventually(t, "only the busy connection left", func() bool { return inbound(b) == 1 })
	// The places are free again.
	move(t, c, b, [][]byte{fill(make([]byte, 4096), 3)}, [][]byte{make([]byte, 4096)})
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 4)}, [][]byte{make([]byte, 4096)})
}

// TestIdleLongSend: one Send whose parts take several idle timeouts to
// copy, during which the socket may carry no message at all (the parts go
// through the ring), is not closed as idle.
func TestIdleLongSend(t *testing.T) {
	const idle = 150 * time.Millisecond
	a := open(t, transport.Options{IdleTimeout: idle, FrameBytes: 64 << 10})
	b := open(t, transport.Options{IdleTimeout: idle})
	const parts = 40 // idle/8 each: 5 idle timeouts
	setHook(t, func() { time.Sleep(idle / 8) })
	start := time.Now()
	move(t, a, b, [][]byte{fill(make([]byte, parts*64<<10), 5)}, [][]byte{make([]byte, parts*64<<10)})
	if took := time.Since(start); took < 4*idle {
		t.Fatalf("the Send took %v, not several idle timeouts (%v): the test proves nothing", took, idle)
	}
}

// TestIdleSenderRetiresFirst: with the same idle timeout on both ends, a
// sender dials anew once its pooled connection has been unused for 3/4 of
// it, so no Send ever meets a connection the receiver is closing: sends
// spaced around both thresholds all deliver.
func TestIdleSenderRetiresFirst(t *testing.T) {
	const idle = 400 * time.Millisecond
	a := open(t, transport.Options{IdleTimeout: idle})
	b := open(t, transport.Options{IdleTimeout: idle})
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 1)}, [][]byte{make([]byte, 4096)})
	first, in1 := pooled(a, b.Endpoint()), onlyInbound(t, b)
	time.Sleep(idle * 7 / 8) // past the sender's 3/4, before the receiver's timeout
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 2)}, [][]byte{make([]byte, 4096)})
	if second := pooled(a, b.Endpoint()); second == nil || second == first {
		t.Fatal("the pooled connection was not retired after 7/8 of the idle timeout")
	}
	// The retired connection ended cleanly on the receiver, which kept
	// the new one.
	eventually(t, "the retired connection closed on the receiver", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		_, old := b.inbound[in1]
		return !old && len(b.inbound) == 1
	})
	rng := rand.New(rand.NewPCG(3, 9))
	for i := range 8 {
		time.Sleep(time.Duration(rng.Int64N(int64(idle * 5 / 4))))
		move(t, a, b, [][]byte{fill(make([]byte, 1<<16), i)}, [][]byte{make([]byte, 1<<16)})
	}
}

// TestIdleRetireRace: Sends from many goroutines, in bursts spaced around
// the sender's retirement threshold, all deliver: one that finds the
// connection retired under it dials anew.
func TestIdleRetireRace(t *testing.T) {
	const idle = 200 * time.Millisecond
	a := open(t, transport.Options{IdleTimeout: idle})
	b := open(t, transport.Options{IdleTimeout: idle})
	for round := range 4 {
		time.Sleep(idle*3/4 + time.Duration(round)*idle/16)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Go(func() { errs <- trySend(a, b, 8192) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
	}
}

// TestIdleNoRetireWithOpOpen: a pooled connection with an op open is not
// retired, however long since it was handed out: a Send past the
// threshold shares it, and both Sends deliver.
func TestIdleNoRetireWithOpOpen(t *testing.T) {
	const idle = 400 * time.Millisecond
	a := open(t, transport.Options{IdleTimeout: idle})
	b := open(t, transport.Options{IdleTimeout: idle})
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 1)}, [][]byte{make([]byte, 4096)})
	oc := pooled(a, b.Endpoint())
	release := make(chan struct{})
	hook, holding := holdFirst(release)
	setHook(t, hook)
	unhold := sync.OnceFunc(func() { close(release) })
	t.Cleanup(unhold) // before the transports close, should the test fail
	errs := make(chan error, 2)
	go func() { errs <- trySend(a, b, 8192) }()
	<-holding
	time.Sleep(idle * 7 / 8) // past the sender's 3/4 with the op open
	go func() { errs <- trySend(a, b, 8192) }()
	eventually(t, "both Sends open on the pooled connection", func() bool {
		oc.mu.Lock()
		defer oc.mu.Unlock()
		return len(oc.pending) == 2
	})
	if pooled(a, b.Endpoint()) != oc {
		t.Error("a pooled connection with an op open was retired")
	}
	unhold()
	for range 2 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

// TestIdleRetiredAsHandedOut: a connection retired after the pool handed
// it out, before its op started (a Send descheduled for 3/4 of the idle
// timeout in between), refuses the op with errRetired, which makes send
// ask the pool again; the retired connection ends cleanly on both sides.
func TestIdleRetiredAsHandedOut(t *testing.T) {
	const idle = 400 * time.Millisecond
	var alog, blog syncbuf.Buffer
	debug := &slog.HandlerOptions{Level: slog.LevelDebug}
	a := open(t, transport.Options{IdleTimeout: idle, Logger: slog.New(slog.NewTextHandler(&alog, debug))})
	b := open(t, transport.Options{IdleTimeout: idle, Logger: slog.New(slog.NewTextHandler(&blog, debug))})
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 1)}, [][]byte{make([]byte, 4096)})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	old, err := a.conn(ctx, b.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	old.used.Add(-int64(idle)) // handed out 3/4 of idle ago, and more
	fresh, err := a.conn(ctx, b.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	if fresh == old {
		t.Fatal("a connection unused for longer than 3/4 of the idle timeout was handed out again")
	}
	if _, err := old.acquire(ctx, 1); !errors.Is(err, errRetired) {
		t.Fatalf("an op on a retired connection: %v, want errRetired", err)
	}
	within(t, 2*time.Second, "the retired connection's reader", func() { <-old.dead })
	if err := old.deadErr(); !errors.Is(err, errRetired) {
		t.Errorf("the retired connection ended with %v, want errRetired", err)
	}
	eventually(t, "one connection left on the receiver", func() bool { return inbound(b) == 1 })
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 2)}, [][]byte{make([]byte, 4096)})
	if pooled(a, b.Endpoint()) != fresh {
		t.Error("the Send after a retirement did not use the new connection")
	}
	// A clean end: nothing logged on either side (a broken connection is
	// logged at debug, a protocol error at warn).
	if l := alog.String() + blog.String(); l != "" {
		t.Errorf("a retirement logged:\n%s", l)
	}
}

// TestNoIdleTimeout: a negative idle timeout keeps idle connections, on
// both ends.
func TestNoIdleTimeout(t *testing.T) {
	a := open(t, transport.Options{IdleTimeout: -1})
	b := open(t, transport.Options{IdleTimeout: -1})
	nc, _ := rawConn(t, b)
	announce(t, nc, testArena(t, 64<<10), 16<<10, 4)
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 1)}, [][]byte{make([]byte, 4096)})
	first := pooled(a, b.Endpoint())
	time.Sleep(200 * time.Millisecond)
	if closedWithin(nc, 50*time.Millisecond) {
		t.Fatal("an idle connection was closed without an idle timeout")
	}
	move(t, a, b, [][]byte{fill(make([]byte, 4096), 2)}, [][]byte{make([]byte, 4096)})
	if pooled(a, b.Endpoint()) != first {
		t.Fatal("a pooled connection was retired without an idle timeout")
	}
}

// trySend sends n bytes from a into a fresh receipt on b, within 5 s,
// and returns the Send's error or the receipt's.
func trySend(a, b *Transport, n int) error {
	r, err := b.Expect([][]byte{make([]byte, n)})
	if err != nil {
		return err
	}
	defer r.Cancel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Send(ctx, r.Descriptor(), [][]byte{make([]byte, n)}); err != nil {
		return err
	}
	<-r.Done()
	return r.Err()
}

// tagOf returns the tag of r's descriptor.
func tagOf(t *testing.T, r transport.Recv) uint64 {
	t.Helper()
	d, err := descFormat.Decode(r.Descriptor())
	if err != nil {
		t.Fatal(err)
	}
	return d.Tag
}

// inbound returns the count of tr's accepted connections.
func inbound(tr *Transport) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return len(tr.inbound)
}

// pooled returns tr's pooled connection to ep, or nil.
func pooled(tr *Transport, ep string) *outConn {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.peers[ep]
}

// eventually fails t unless cond holds within 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not true after 5 s: %s", what)
		}
	}
}

// closedWithin reports whether the peer of nc closes it within wait
// (reading and dropping what it writes meanwhile).
func closedWithin(nc *net.UnixConn, wait time.Duration) bool {
	nc.SetReadDeadline(time.Now().Add(wait))
	defer nc.SetReadDeadline(time.Time{})
	var buf [256]byte
	for {
		_, err := nc.Read(buf[:])
		if err != nil {
			return !errors.Is(err, os.ErrDeadlineExceeded)
		}
	}
}

// TestMsgReaderAfterDeadline: a read deadline that passes inside a message
// loses nothing: the next call returns the whole message, as the idle
// check needs (it lets the reader go on after a deadline).
func TestMsgReaderAfterDeadline(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c.(*net.UnixConn)
	}
	w, mr := conns[0], newMsgReader(conns[1])
	defer mr.closeFds()
	want := []msg{
		{typ: msgCancel, op: 7, seq: 12},
		{typ: msgErr, op: 9, code: codeRegion, text: "a reason of some length"},
		{typ: msgPost, seq: 3},
	}
	var b []byte
	for i := range want {
		b = appendMsg(b, &want[i])
	}
	// Cut inside the first message's header, inside the second message,
	// and at the boundary before the third.
	first := len(appendMsg(nil, &want[0]))
	second := len(appendMsg(nil, &want[1]))
	cuts := []int{0, 2, first + 5, first + second, len(b)}
	var got []msg
	for i := 1; i < len(cuts); i++ {
		if _, err := w.Write(b[cuts[i-1]:cuts[i]]); err != nil {
			t.Fatal(err)
		}
		for {
			conns[1].SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			m, err := mr.next()
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break // wait for the next piece
			}
			if err != nil {
				t.Fatalf("after %d of %d bytes: %v", cuts[i], len(b), err)
			}
			got = append(got, m)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("got %d messages %+v, want %+v", len(got), got, want)
	}
	for i := range want {
		if got[i].typ != want[i].typ || got[i].op != want[i].op || got[i].seq != want[i].seq || got[i].code != want[i].code || got[i].text != want[i].text {
			t.Errorf("message %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}
