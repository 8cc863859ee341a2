package tcp

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// TestIdleConnectionsClosed: connections with a valid preface that then
// carry nothing, or stop inside a frame, are closed at the idle timeout
// and free their places; a connection that keeps carrying frames is kept
// past it, and its receipts complete.
func TestIdleConnectionsClosed(t *testing.T) {
	const idle = 300 * time.Millisecond
	b := open(t, transport.Options{IdleTimeout: idle})
	silent := rawConn(t, b, 71)
	midFrame := rawConn(t, b, 72)
	// A header for an unknown tag announcing 1 MiB, then 100 bytes of it.
	f := frame(12345, 0, make([]byte, 1<<20))
	if _, err := midFrame.Write(f[:headerLen+100]); err != nil {
		t.Fatal(err)
	}
	busy := rawConn(t, b, 73)
	dst := make([]byte, 8)
	r, err := b.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	// busy writes a frame for an unknown tag every idle/3, and at the end
	// the receipt's bytes.
	for time.Since(start) < 2*idle {
		if _, err := busy.Write(frame(999, 0, make([]byte, 64))); err != nil {
			t.Fatalf("a busy connection broke: %v", err)
		}
		time.Sleep(idle / 3)
	}
	for _, c := range []struct {
		name string
		ok   bool
	}{{"silent after its preface", closedByPeer(silent)}, {"stalled inside a frame", closedByPeer(midFrame)}} {
		if !c.ok {
			t.Errorf("a connection %s was kept past the idle timeout", c.name)
		}
	}
	if took := time.Since(start); took > 10*idle {
		t.Errorf("idle connections closed after %v, idle timeout %v", took, idle)
	}
	if _, err := busy.Write(frame(tagOf(t, r), 0, seq(8, 5))); err != nil {
		t.Fatal(err)
	}
	within(t, 5*time.Second, "the busy connection's receipt", func() { <-r.Done() })
	if err := r.Err(); err != nil || string(dst) != string(seq(8, 5)) {
		t.Fatalf("the busy connection's receipt: %v, %v", err, dst)
	}
	eventually(t, "only the busy connection left", func() bool { n, _ := b.inboundCounts(); return n == 1 })
}

// TestIdleSenderRetiresFirst: with the same idle timeout on both ends, a
// sender dials anew once its pooled connections have been unused for 3/4
// of it, so no Send ever meets a connection the receiver is closing: sends
// spaced around both thresholds all deliver.
func TestIdleSenderRetiresFirst(t *testing.T) {
	const idle = 400 * time.Millisecond
	a := open(t, transport.Options{IdleTimeout: idle, Streams: 1})
	b := open(t, transport.Options{IdleTimeout: idle})
	move(t, a, b, [][]byte{seq(4096, 1)}, [][]byte{make([]byte, 4096)})
	first := b.remotes()
	time.Sleep(idle * 7 / 8) // past the sender's 3/4, before the receiver's timeout
	move(t, a, b, [][]byte{seq(4096, 2)}, [][]byte{make([]byte, 4096)})
	// The second Send dialled anew (the receiver would still have kept
	// the first connection for idle/8).
	if now := b.remotes(); len(first) != 1 || slices.Contains(now, first[0]) && len(now) == 1 {
		t.Fatalf("connections %v then %v: the pooled connection was not retired", first, now)
	}
	eventually(t, "the retired connection closed on the receiver", func() bool { n, _ := b.inboundCounts(); return n == 1 })
	if n := a.pooled(b.Endpoint()); n != 1 {
		t.Fatalf("%d pooled connections after a retirement, want 1", n)
	}
	rng := rand.New(rand.NewPCG(3, 9))
	for i := range 8 {
		time.Sleep(time.Duration(rng.Int64N(int64(idle * 5 / 4))))
		move(t, a, b, [][]byte{seq(1<<16, byte(i))}, [][]byte{make([]byte, 1<<16)})
	}
}

// TestNoIdleTimeout: a negative idle timeout keeps idle connections.
func TestNoIdleTimeout(t *testing.T) {
	b := open(t, transport.Options{IdleTimeout: -1})
	c := rawConn(t, b, 81)
	time.Sleep(100 * time.Millisecond)
	if !openByPeer(c) {
		t.Fatal("an idle connection was closed without an idle timeout")
	}
}

// remotes returns the remote addresses of t's inbound connections.
func (t *Transport) remotes() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for c := range t.inbound {
		out = append(out, c.remote)
	}
	return out
}
