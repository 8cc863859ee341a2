//go:build linux

package shm

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// stop pauses the child process (SIGSTOP), as a receiver that stalls (a
// paused process, a machine swapping) would be; it is continued at the
// end of t at the latest.
func (c *child) stop(t *testing.T) {
	t.Helper()
	if err := syscall.Kill(c.cmd.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.cont(t) })
	// The signal is delivered when the child's threads next run: wait
	// until the kernel says it is stopped.
	stat := fmt.Sprintf("/proc/%d/stat", c.cmd.Process.Pid)
	eventually(t, "the child stopped", func() bool {
		b, err := os.ReadFile(stat)
		if err != nil {
			return false
		}
		// The state follows the command's closing parenthesis.
		_, rest, ok := bytes.Cut(b, []byte(") "))
		return ok && len(rest) > 0 && rest[0] == 'T'
	})
}

// cont continues the child paused by stop.
func (c *child) cont(t *testing.T) {
	t.Helper()
	if err := syscall.Kill(c.cmd.Process.Pid, syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
		t.Error(err)
	}
}

// lineWithin is line with a bound of its own: the rest of the child's
// next line that starts with prefix, or false when none came within limit.
func (c *child) lineWithin(t *testing.T, prefix string, limit time.Duration) (string, bool) {
	t.Helper()
	timer := time.NewTimer(limit)
	defer timer.Stop()
	for {
		select {
		case l := <-c.lines:
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return strings.TrimSpace(rest), true
			}
			t.Logf("child: %s", l)
		case <-c.done:
			return "", false
		case <-timer.C:
			return "", false
		}
	}
}

// TestAbortReachesStalledReceiver: a Send that times out while its receiver
// process is paused for longer than the ABORT's grace, before it could
// post a part (the dial's HELLO went unanswered), still fails the receipt
// once the receiver runs again, instead of leaving it armed until the
// receiver's own deadline (the child's: 30 s).
func TestAbortReachesStalledReceiver(t *testing.T) {
	const n = 1 << 20
	a := open(t, transport.Options{})
	src := fill(shared(t, n, a), 42)
	c := startChild(t, "recv", n, false)
	c.line(t, "EP ")
	desc, err := hex.DecodeString(c.line(t, "DESC "))
	if err != nil {
		t.Fatal(err)
	}
	c.stop(t)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var serr error
	within(t, 5*time.Second, "Send to a paused receiver", func() { serr = a.Send(ctx, desc, [][]byte{src}) })
	var te *transport.TimeoutError
	if !errors.As(serr, &te) {
		t.Fatalf("Send = %v, want a TimeoutError", serr)
	}
	time.Sleep(2 * grace) // well past the ABORT's grace
	c.cont(t)
	got, ok := c.lineWithin(t, "RECV ", 10*time.Second)
	if !ok {
		t.Fatal("receipt of the timed-out Send still armed 10 s after its receiver ran again")
	}
	if !strings.Contains(got, transport.ErrAborted.Error()) {
		t.Errorf("child: RECV %s, want %q", got, transport.ErrAborted)
	}
}

// TestLateAbortEnds: the delivery of a late ABORT to a paused receiver
// ends with the Transport's Close, and soon after the receiver's process
// dies (nothing listens at its endpoint any more), rather than at
// abortPatience.
func TestLateAbortEnds(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(t *testing.T, a *Transport, c *child)
	}{
		{"Close", func(_ *testing.T, a *Transport, _ *child) { a.Close() }},
		{"receiver killed", func(t *testing.T, _ *Transport, c *child) { c.kill(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 64 << 10
			a := open(t, transport.Options{})
			c := startChild(t, "recv", n, false)
			ep := c.line(t, "EP ")
			desc, err := hex.DecodeString(c.line(t, "DESC "))
			if err != nil {
				t.Fatal(err)
			}
			c.stop(t)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			if err := a.Send(ctx, desc, [][]byte{make([]byte, n)}); err == nil {
				t.Fatal("Send to a paused receiver succeeded")
			}
			if !a.abortsPending(ep) {
				t.Fatal("no late ABORT pending after the Send")
			}
			start := time.Now()
			tc.end(t, a, c)
			eventually(t, "late ABORT given up", func() bool { return !a.abortsPending(ep) })
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("late ABORT given up after %v, want well under abortPatience (%v)", d, abortPatience)
			}
		})
	}
}

// abortsPending reports whether late ABORTs to ep are being delivered.
func (t *Transport) abortsPending(ep string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.aborts[ep]
	return ok
}

// TestGiveUpOnePart: a Send of one part that gives up on its op while the
// receiver has the POST and not the part (its reader is held just before
// it takes the part from the ring, past the CANCEL's grace, as a paused
// process would be) must not have its receipt completed when the receiver
// runs again: the sender marks the part's ring entry as given up before
// it writes the CANCEL, and the receiver reads the mark before it
// completes the receipt.
func TestGiveUpOnePart(t *testing.T) {
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	const n = 64 << 10
	src := fill(shared(t, 1<<20, a), 5)
	healthy(t, a, b, src) // the connection is up
	c := onlyInbound(t, b)
	workerAsleep(t, c)
	release := holdPull(t, c) // the reader stops in the POST's pull
	dst := make([]byte, n)
	r, err := b.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	res := make(chan error, 1)
	go func() { res <- a.Send(ctx, r.Descriptor(), [][]byte{src[:n]}) }()
	waitPosted(t, a, b, 2)            // healthy's part, then this one
	time.Sleep(50 * time.Millisecond) // the POST is read, or in the socket
	cancel()
	var serr error
	within(t, 5*time.Second, "Send", func() { serr = <-res })
	if !errors.Is(serr, context.Canceled) {
		t.Fatalf("Send = %v, want context.Canceled (the sender gave up)", serr)
	}
	release()
	within(t, 5*time.Second, "Recv", func() { <-r.Done() })
	if err := r.Err(); !errors.Is(err, transport.ErrAborted) {
		t.Errorf("Recv.Err = %v after its Send gave up (%v), want ErrAborted", err, serr)
	}
	healthy(t, a, b, src) // a redials
}

// TestGiveUpStalledReceiver: the same between two processes, the
// receiver's process paused (SIGSTOP) with its connection idle, past the
// CANCEL's grace of a Send that timed out after posting its one part:
// when it runs again it reads the POST and the CANCEL at once, and its
// receipt fails (ErrAborted) rather than completing behind the back of a
// Send that returned an error.
func TestGiveUpStalledReceiver(t *testing.T) {
	const n = 64 << 10
	a := open(t, transport.Options{})
	src := fill(shared(t, n, a), 42)
	c := startChild(t, "recv2", n, false)
	c.line(t, "EP ")
	send := func(timeout time.Duration) error {
		desc, err := hex.DecodeString(c.line(t, "DESC "))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		var serr error
		within(t, 10*time.Second, "Send", func() { serr = a.Send(ctx, desc, [][]byte{src}) })
		return serr
	}
	if err := send(10 * time.Second); err != nil { // the connection is up
		t.Fatalf("first Send: %v", err)
	}
	if got := c.line(t, "RECV "); got != "ok" {
		t.Fatalf("child: first RECV %s", got)
	}
	time.Sleep(100 * time.Millisecond) // the child's worker and reader go to sleep
	c.stop(t)
	// The child printed its second DESC before it was stopped.
	serr := send(50 * time.Millisecond)
	var te *transport.TimeoutError
	if !errors.As(serr, &te) {
		t.Fatalf("Send to a paused receiver = %v, want a TimeoutError", serr)
	}
	c.cont(t)
	got, ok := c.lineWithin(t, "RECV ", 10*time.Second)
	if !ok {
		t.Fatal("no RECV from the child 10 s after it ran again")
	}
	if !strings.Contains(got, transport.ErrAborted.Error()) {
		t.Errorf("child: RECV %s after its Send returned %v, want %q", got, serr, transport.ErrAborted)
	}
}

// TestGiveUpOnKill: two one-part Sends on one connection to a receiver
// that stalls with both parts posted: A gives up, its CANCEL goes
// unanswered past the grace and the connection is closed, so B's Send
// fails too (ErrPeerLost). Neither receipt may complete when the receiver
// runs again: the connection's close marks every op still waiting.
func TestGiveUpOnKill(t *testing.T) {
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	const n = 64 << 10
	src := fill(shared(t, 1<<20, a), 5)
	healthy(t, a, b, src)
	c := onlyInbound(t, b)
	workerAsleep(t, c)
	release := holdPull(t, c) // the reader stops in the first POST's pull
	rA, err := b.Expect([][]byte{make([]byte, n)})
	if err != nil {
		t.Fatal(err)
	}
	rB, err := b.Expect([][]byte{make([]byte, n)})
	if err != nil {
		t.Fatal(err)
	}
	resB := make(chan error, 1)
	go func() { resB <- a.Send(context.Background(), rB.Descriptor(), [][]byte{src[:n]}) }()
	waitPosted(t, a, b, 2) // healthy's part, then B's
	ctx, cancel := context.WithCancel(context.Background())
	resA := make(chan error, 1)
	go func() { resA <- a.Send(ctx, rA.Descriptor(), [][]byte{src[:n]}) }()
	waitPosted(t, a, b, 3)
	time.Sleep(50 * time.Millisecond)
	cancel()
	var errA, errB error
	within(t, 5*time.Second, "Send A", func() { errA = <-resA })
	within(t, 5*time.Second, "Send B", func() { errB = <-resB })
	if !errors.Is(errA, context.Canceled) || !errors.Is(errB, transport.ErrPeerLost) {
		t.Fatalf("Send A = %v, Send B = %v; want context.Canceled, then ErrPeerLost as A's connection is closed", errA, errB)
	}
	release()
	within(t, 5*time.Second, "the receipts to end", func() {
		<-rA.Done()
		<-rB.Done()
	})
	if err := rA.Err(); !errors.Is(err, transport.ErrAborted) {
		t.Errorf("Recv A = %v after its Send gave up, want ErrAborted", err)
	}
	if err := rB.Err(); err == nil {
		t.Errorf("Recv B completed although its Send returned %v", errB)
	}
}

// TestManySendersAtOnce: 48 senders send their first transfer to one
// receiver at once; every one connects, has its window taken, and
// delivers (a bound on the receiver's descriptors must not refuse
// legitimate windows).
func TestManySendersAtOnce(t *testing.T) {
	b := open(t, transport.Options{})
	const senders = 48
	src := fill(make([]byte, 4096), 3)
	errs := make(chan error, senders)
	start := make(chan struct{})
	for range senders {
		a := open(t, transport.Options{})
		r, err := b.Expect([][]byte{make([]byte, 4096)})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			errs <- a.Send(ctx, r.Descriptor(), [][]byte{src})
		}()
	}
	close(start)
	failed := 0
	for range senders {
		if err := <-errs; err != nil {
			if failed++; failed <= 3 {
				t.Errorf("Send: %v", err)
			}
		}
	}
	if failed > 0 {
		t.Errorf("%d of %d first Sends at once failed", failed, senders)
	}
}

// TestHostileSilentConnections: connections that dial the receiver and
// say nothing (up to the hello deadline) do not keep a sender that
// connects meanwhile from having its window taken.
func TestHostileSilentConnections(t *testing.T) {
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	for range 2 * maxStuckCloses {
		c, err := net.Dial("unix", b.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	time.Sleep(100 * time.Millisecond) // their readers wait for a HELLO
	healthy(t, a, b, fill(shared(t, 1<<20, a), 3))
}

// holdPull holds c's pullMu, so that its reader stops in its next pull
// (a POST's), until release is called or t ends.
func holdPull(t *testing.T, c *inConn) (release func()) {
	c.pullMu.Lock()
	var once sync.Once
	release = func() { once.Do(c.pullMu.Unlock) }
	t.Cleanup(release)
	return release
}

// waitPosted waits until a's connection to b has posted k parts in all.
func waitPosted(t *testing.T, a, b *Transport, k uint64) {
	t.Helper()
	a.mu.Lock()
	oc := a.peers[b.Endpoint()]
	a.mu.Unlock()
	within(t, 5*time.Second, fmt.Sprintf("%d parts to be posted", k), func() {
		for {
			oc.mu.Lock()
			posted := oc.posted
			oc.mu.Unlock()
			if posted >= k {
				return
			}
			time.Sleep(100 * time.Microsecond)
		}
	})
}
