package tcp

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

func TestMain(m *testing.M) {
	if os.Getenv(peerEnv) != "" {
		os.Exit(peerMain()) // the peer process of BenchmarkOpProcess
	}
	if os.Getenv(bulkPeerEnv) != "" {
		os.Exit(bulkPeerMain()) // the peer process of BenchmarkBulkProcess
	}
	goleak.VerifyTestMain(m)
}

// open opens a tcp Transport on loopback and closes it in t.Cleanup.
func open(t *testing.T, opts transport.Options) *Transport {
	t.Helper()
	tr, err := Open(context.Background(), opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (a, b transport.Transport) {
		return open(t, transport.Options{}), open(t, transport.Options{})
	})
}

// TestConformanceSmallFrames runs the suite again with many small frames
// over more streams than frames of most transfers.
func TestConformanceSmallFrames(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode")
	}
	opts := transport.Options{Streams: 4, FrameBytes: 256<<10 + 1}
	transporttest.RunOptions(t, func(t *testing.T) (a, b transport.Transport) {
		return open(t, opts), open(t, opts)
	}, transporttest.Options{SkipLarge: true}) // 64 MiB is 256 frames
}

func TestRegistered(t *testing.T) {
	st, err := transport.Lookup("TCP")
	if err != nil || !st.Available() {
		t.Fatalf("Lookup(tcp) = %+v, %v; want available", st, err)
	}
	tr, err := transport.Open(context.Background(), "tcp", transport.Options{})
	if err != nil {
		t.Fatalf("transport.Open(tcp): %v", err)
	}
	defer tr.Close()
	if tr.Name() != "tcp" {
		t.Errorf("Name = %q", tr.Name())
	}
	if host, _, err := net.SplitHostPort(tr.Endpoint()); err != nil || host != "127.0.0.1" {
		t.Errorf("Endpoint = %q, want 127.0.0.1:port", tr.Endpoint())
	}
}

// within fails t unless f returns within limit.
func within(t *testing.T, limit time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { f(); close(done) }()
	timer := time.NewTimer(limit)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		t.Fatalf("%s: not done after %v", what, limit)
	}
}

// move sends src from a into a fresh receipt on b and checks the bytes.
func move(t *testing.T, a, b *Transport, src, dst [][]byte) {
	t.Helper()
	r, err := b.Expect(dst)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Send(ctx, r.Descriptor(), src); err != nil {
		t.Fatalf("Send: %v", err)
	}
	within(t, 10*time.Second, "Recv", func() { <-r.Done() })
	if err := r.Err(); err != nil {
		t.Fatalf("Recv: %v", err)
	}
	if !bytes.Equal(bytes.Join(dst, nil), bytes.Join(src, nil)) {
		t.Fatal("bytes differ")
	}
}

func seq(n int, start byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = start + byte(i*7+i/251)
	}
	return b
}

// inbound reports b's accepted connections and sessions.
func (t *Transport) inboundCounts() (conns, sessions int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.inbound), len(t.sessions)
}

// pooled reports how many connections a has open to ep.
func (t *Transport) pooled(ep string) int {
	t.mu.Lock()
	p := t.peers[ep]
	t.mu.Unlock()
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, oc := range p.slots {
		if oc != nil {
			n++
		}
	}
	return n
}

// eventually polls cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after 5s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestStreams(t *testing.T) {
	for _, streams := range []int{1, 3} {
		a := open(t, transport.Options{Streams: streams, FrameBytes: 64 << 10})
		b := open(t, transport.Options{})
		// One frame: one connection, whatever Streams says.
		move(t, a, b, [][]byte{seq(100, 1)}, [][]byte{make([]byte, 100)})
		if n := a.pooled(b.Endpoint()); n != 1 {
			t.Errorf("streams %d: %d connections after a one-frame Send, want 1", streams, n)
		}
		move(t, a, b, [][]byte{seq(1<<20, 2)}, [][]byte{make([]byte, 1<<20)})
		if n := a.pooled(b.Endpoint()); n != streams {
			t.Errorf("streams %d: %d connections after a 16-frame Send, want %d", streams, n, streams)
		}
		eventually(t, "connections accepted", func() bool {
			c, s := b.inboundCounts()
			return c == streams && s == 1
		})
		a.Close()
		eventually(t, "connections closed", func() bool {
			c, s := b.inboundCounts()
			return c == 0 && s == 0
		})
	}
}

func TestFrameBoundaries(t *testing.T) {
	for _, want := range []int{1, 63, 1000, 4096} {
		a := open(t, transport.Options{FrameBytes: want, Streams: 3})
		b := open(t, transport.Options{})
		fb := a.opts.FrameBytes // 1000 is rounded down to 960
		if fb > want || (want >= frameAlign && fb%frameAlign != 0) {
			t.Fatalf("FrameBytes %d became %d", want, fb)
		}
		for _, n := range []int{1, fb - 1, fb, fb + 1, 2 * fb, 3*fb - 1, 3*fb + 1, 7*fb + 5} {
			if n <= 0 || (fb == 1 && n > 50) {
				continue
			}
			all := seq(n, byte(n))
			// Pieces that cross frame boundaries, and empty ones.
			var src [][]byte
			for off, i := 0, 0; off < n; i++ {
				k := min(n-off, 1+(i*389)%(fb+3))
				src = append(src, all[off:off+k], nil)
				off += k
			}
			dst := [][]byte{make([]byte, n/2), {}, make([]byte, n-n/2)}
			move(t, a, b, src, dst)
		}
	}
}

// rawConn dials tr and writes a preface for session.
func rawConn(t *testing.T, tr *Transport, session uint64) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", tr.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if session != 0 {
		var pre [prefaceLen]byte
		putPreface(pre[:], session)
		if _, err := c.Write(pre[:]); err != nil {
			t.Fatal(err)
		}
		// The receiver's accept: read, as a sender does, so that a close
		// by the test is a clean end rather than a reset.
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err != nil || b[0] != acceptByte {
			t.Fatalf("the receiver's accept: %q, %v", b, err)
		}
		c.SetReadDeadline(time.Time{})
	}
	return c
}

func header(h frameHeader) []byte {
	b := make([]byte, headerLen)
	putHeader(b, h)
	return b
}

// frame encodes a DATA frame with its padding.
func frame(tag, offset uint64, payload []byte) []byte {
	b := header(frameHeader{typ: frameData, length: uint32(len(payload)), tag: tag, offset: offset})
	b = append(b, payload...)
	return append(b, zeros[:padLen(int64(len(payload)))]...)
}

// closedByPeer reports whether the receiver closed c within 5 s.
func closedByPeer(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.Read(make([]byte, 1))
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}

// openByPeer reports whether c is still open after a short while.
func openByPeer(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	_, err := c.Read(make([]byte, 1))
	return errors.Is(err, os.ErrDeadlineExceeded)
}

func tagOf(t *testing.T, r transport.Recv) uint64 {
	t.Helper()
	d, err := descFormat.Decode(r.Descriptor())
	if err != nil {
		t.Fatal(err)
	}
	return d.Tag
}

func TestMalformedFrames(t *testing.T) {
	a := open(t, transport.Options{})
	b := open(t, transport.Options{})
	move(t, a, b, [][]byte{seq(10, 0)}, [][]byte{make([]byte, 10)}) // a's pool is up

	bad := []struct {
		name string
		data []byte
	}{
		{"bad preface", []byte("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: test\r\nAccept: */*\r\n\r\n")},
		{"unknown type", header(frameHeader{typ: 9, length: 1, tag: 1})},
		{"reserved bytes", func() []byte { h := header(frameHeader{typ: frameData, length: 1, tag: 1}); h[2] = 1; return h }()},
		{"oversized", header(frameHeader{typ: frameData, length: maxFrameBytes + 1, tag: 1})},
		{"empty data frame", header(frameHeader{typ: frameData, length: 0, tag: 1})},
		{"abort with payload", header(frameHeader{typ: frameAbort, length: 4, tag: 1})},
	}
	for _, c := range bad {
		session := uint64(0)
		if c.name != "bad preface" {
			session = 42
		}
		conn := rawConn(t, b, session)
		if _, err := conn.Write(c.data); err != nil {
			t.Fatal(err)
		}
		if !closedByPeer(conn) {
			t.Errorf("%s: connection not closed by the receiver", c.name)
		}
		move(t, a, b, [][]byte{seq(1<<20, 3)}, [][]byte{make([]byte, 1<<20)})
	}

	// A frame beyond its receipt: that receipt fails with ErrProtocol.
	dst := [][]byte{make([]byte, 100)}
	r, _ := b.Expect(dst)
	conn := rawConn(t, b, 43)
	conn.Write(header(frameHeader{typ: frameData, length: 10, tag: tagOf(t, r), offset: 95}))
	if !closedByPeer(conn) {
		t.Error("frame beyond its receipt: connection not closed")
	}
	within(t, 5*time.Second, "Recv", func() { <-r.Done() })
	if !errors.Is(r.Err(), transport.ErrProtocol) {
		t.Errorf("frame beyond its receipt: Recv.Err = %v, want ErrProtocol", r.Err())
	}

	// Overlapping frames that add up to more than the receipt: ErrProtocol
	// for the receipt, the connection stays.
	r, _ = b.Expect([][]byte{make([]byte, 100)})
	conn = rawConn(t, b, 45)
	conn.Write(frame(tagOf(t, r), 0, make([]byte, 64)))
	conn.Write(frame(tagOf(t, r), 0, make([]byte, 64)))
	within(t, 5*time.Second, "Recv", func() { <-r.Done() })
	if !errors.Is(r.Err(), transport.ErrProtocol) {
		t.Errorf("overlapping frames: Recv.Err = %v, want ErrProtocol", r.Err())
	}
	if !openByPeer(conn) {
		t.Error("overlapping frames: connection closed")
	}

	// A frame for an unknown tag is dropped; the connection stays.
	conn = rawConn(t, b, 44)
	conn.Write(header(frameHeader{typ: frameData, length: 100 << 10, tag: 12345}))
	conn.Write(make([]byte, 100<<10))
	conn.Write(header(frameHeader{typ: frameAbort, tag: 12345}))
	if !openByPeer(conn) {
		t.Error("unknown tag: connection closed")
	}
	// ...and a frame for a real receipt on it still lands.
	dst = [][]byte{make([]byte, 5)}
	r, _ = b.Expect(dst)
	conn.Write(frame(tagOf(t, r), 0, []byte("hello")))
	within(t, 5*time.Second, "Recv", func() { <-r.Done() })
	if r.Err() != nil || string(dst[0]) != "hello" {
		t.Errorf("after an unknown tag: Recv = %v, %q", r.Err(), dst[0])
	}
	move(t, a, b, [][]byte{seq(1<<20, 4)}, [][]byte{make([]byte, 1<<20)})
}

func TestConnectionLoss(t *testing.T) {
	b := open(t, transport.Options{})

	t.Run("mid-frame", func(t *testing.T) {
		r, _ := b.Expect([][]byte{make([]byte, 100)})
		conn := rawConn(t, b, 50)
		conn.Write(header(frameHeader{typ: frameData, length: 100, tag: tagOf(t, r)}))
		conn.Write(make([]byte, 40))
		conn.Close()
		within(t, 5*time.Second, "Recv", func() { <-r.Done() })
		if !errors.Is(r.Err(), transport.ErrPeerLost) {
			t.Errorf("Recv.Err = %v, want ErrPeerLost", r.Err())
		}
	})
	t.Run("last connection of the session, between frames", func(t *testing.T) {
		r, _ := b.Expect([][]byte{make([]byte, 100)})
		c1, c2 := rawConn(t, b, 51), rawConn(t, b, 51)
		sessionConns(t, b, 51, 2)
		c1.Write(frame(tagOf(t, r), 0, make([]byte, 50)))
		c1.Close()
		if !openByPeer(c2) {
			t.Fatal("c2 closed")
		}
		select {
		case <-r.Done():
			t.Fatalf("receipt ended while its sender still had a connection: %v", r.Err())
		default:
		}
		c2.Close()
		within(t, 5*time.Second, "Recv", func() { <-r.Done() })
		if !errors.Is(r.Err(), transport.ErrPeerLost) {
			t.Errorf("Recv.Err = %v, want ErrPeerLost", r.Err())
		}
	})
	t.Run("clean end after the last bytes on another connection", func(t *testing.T) {
		dst := [][]byte{make([]byte, 100)}
		r, _ := b.Expect(dst)
		c1, c2 := rawConn(t, b, 52), rawConn(t, b, 52)
		sessionConns(t, b, 52, 2)
		c1.Write(frame(tagOf(t, r), 0, seq(50, 0)))
		c1.Close()
		c2.Write(frame(tagOf(t, r), 50, seq(50, 50)))
		c2.Close()
		within(t, 5*time.Second, "Recv", func() { <-r.Done() })
		if r.Err() != nil || !bytes.Equal(dst[0], append(seq(50, 0), seq(50, 50)...)) {
			t.Errorf("Recv.Err = %v", r.Err())
		}
	})
	t.Run("second sender", func(t *testing.T) {
		r, _ := b.Expect([][]byte{make([]byte, 100)})
		c1, c2 := rawConn(t, b, 53), rawConn(t, b, 54)
		c1.Write(frame(tagOf(t, r), 0, make([]byte, 50)))
		eventually(t, "first frame read", func() bool {
			b.mu.Lock()
			defer b.mu.Unlock()
			return r.(*recv).Fill.session != nil
		})
		c2.Write(frame(tagOf(t, r), 50, make([]byte, 50)))
		within(t, 5*time.Second, "Recv", func() { <-r.Done() })
		if !errors.Is(r.Err(), transport.ErrProtocol) {
			t.Errorf("Recv.Err = %v, want ErrProtocol", r.Err())
		}
		if !openByPeer(c2) {
			t.Error("second sender's connection closed")
		}
	})
}

// sessionConns waits until b has read the prefaces of n connections of
// session id.
func sessionConns(t *testing.T, b *Transport, id uint64, n int) {
	t.Helper()
	eventually(t, "connections in the session", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.sessions[id] != nil && b.sessions[id].conns == n
	})
}

// TestCancelMidFrame: Cancel interrupts a reader blocked in the middle of a
// frame at once (well within the grace), and the connection survives.
func TestCancelMidFrame(t *testing.T) {
	b := open(t, transport.Options{})
	dst := [][]byte{make([]byte, 1000)}
	r, _ := b.Expect(dst)
	conn := rawConn(t, b, 60)
	conn.Write(header(frameHeader{typ: frameData, length: 1000, tag: tagOf(t, r)}))
	conn.Write(make([]byte, 300))
	eventually(t, "reader in the frame", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		for c := range b.inbound {
			if c.cur == r.(*recv) {
				return true
			}
		}
		return false
	})
	start := time.Now()
	within(t, 5*time.Second, "Cancel", r.Cancel)
	if d := time.Since(start); d >= cancelGrace {
		t.Errorf("Cancel took %v, want less than the grace %v", d, cancelGrace)
	}
	if !errors.Is(r.Err(), transport.ErrCanceled) {
		t.Errorf("Err = %v", r.Err())
	}
	for i := range dst[0] {
		dst[0][i] = 0xee
	}
	conn.Write(append(seq(700, 1), zeros[:padLen(1000)]...)) // the rest of the frame, dropped
	dst2 := [][]byte{make([]byte, 3)}
	r2, _ := b.Expect(dst2)
	conn.Write(frame(tagOf(t, r2), 0, []byte("abc")))
	within(t, 5*time.Second, "Recv", func() { <-r2.Done() })
	if r2.Err() != nil || string(dst2[0]) != "abc" {
		t.Errorf("after Cancel: Recv = %v, %q", r2.Err(), dst2[0])
	}
	if !bytes.Equal(dst[0], bytes.Repeat([]byte{0xee}, 1000)) {
		t.Error("dst written after Cancel")
	}
}

// TestSendStalledPeer: a peer that accepts but never reads. Send with a
// deadline returns a TimeoutError within a few grace periods, and the
// corrupt connections leave the pool.
func TestSendStalledPeer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 16)
	go func() {
		defer close(accepted)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	defer func() {
		ln.Close()
		for c := range accepted {
			c.Close()
		}
	}()

	a := open(t, transport.Options{})
	const n = 64 << 20
	desc := descFormat.Encode(receipt.Descriptor{Endpoint: ln.Addr().String(), Tag: 7, Total: n})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	var serr error
	within(t, 10*time.Second, "Send", func() { serr = a.Send(ctx, desc, [][]byte{make([]byte, n)}) })
	var te *transport.TimeoutError
	if !errors.As(serr, &te) || !errors.Is(serr, context.DeadlineExceeded) {
		t.Errorf("Send = %v, want a TimeoutError", serr)
	}
	t.Logf("Send returned after %v: %v", time.Since(start), serr)
	// The connections that were cut mid-frame are gone; at most the one
	// dialled for the ABORT remains.
	if p := a.pooled(ln.Addr().String()); p > 1 {
		t.Errorf("%d connections pooled, want at most 1", p)
	}
}

// TestPeerRestart: after the receiver restarts on the same address, the
// sender notices its pooled connections died and redials.
func TestPeerRestart(t *testing.T) {
	a := open(t, transport.Options{})
	b := open(t, transport.Options{})
	ep := b.Endpoint()
	move(t, a, b, [][]byte{seq(1<<20, 1)}, [][]byte{make([]byte, 1<<20)})
	b.Close()
	eventually(t, "pool emptied", func() bool { return a.pooled(ep) == 0 })
	b2, err := Open(context.Background(), transport.Options{ListenAddr: ep})
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", ep, err)
	}
	defer b2.Close()
	move(t, a, b2, [][]byte{seq(1<<20, 2)}, [][]byte{make([]byte, 1<<20)})
}

// TestNoAllocsPerFrame: a Send of many frames allocates no more than a Send
// of one (sender and receiver together).
func TestNoAllocsPerFrame(t *testing.T) {
	a := open(t, transport.Options{FrameBytes: 16 << 10})
	b := open(t, transport.Options{})
	allocs := func(n int) float64 {
		src := [][]byte{make([]byte, n)}
		dst := [][]byte{make([]byte, n)}
		move(t, a, b, src, dst) // warm up: connections, scratch
		return testing.AllocsPerRun(20, func() {
			r, err := b.Expect(dst)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Send(context.Background(), r.Descriptor(), src); err != nil {
				t.Fatal(err)
			}
			<-r.Done()
		})
	}
	one, many := allocs(16<<10), allocs(256*16<<10)
	t.Logf("allocs per Send: 1 frame %.1f, 256 frames %.1f", one, many)
	if many > one+16 {
		t.Errorf("256 frames allocate %.1f, 1 frame %.1f: something allocates per frame", many, one)
	}
}

func TestDescriptor(t *testing.T) {
	good := receipt.Descriptor{Endpoint: "127.0.0.1:5000", Tag: 99, Total: 1 << 40}
	d, err := descFormat.Decode(descFormat.Encode(good))
	if err != nil || d != good {
		t.Fatalf("round trip: %+v, %v", d, err)
	}
	bad := []receipt.Descriptor{
		{Endpoint: "", Tag: 1, Total: 1},
		{Endpoint: "host", Tag: 1, Total: 1},
		{Endpoint: ":80", Tag: 1, Total: 1},
		{Endpoint: "h:0", Tag: 1, Total: 1},
		{Endpoint: "h:65536", Tag: 1, Total: 1},
		{Endpoint: "h:http", Tag: 1, Total: 1},
		{Endpoint: "h\x00:80", Tag: 1, Total: 1},
		{Endpoint: "h:80", Tag: 0, Total: 1},
		{Endpoint: "h:80", Tag: 1, Total: 0},
		{Endpoint: "h:80", Tag: 1, Total: -1},
	}
	for _, c := range bad {
		if _, err := descFormat.Decode(descFormat.Encode(c)); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("%+v: err = %v, want ErrBadDescriptor", c, err)
		} else {
			t.Log(err)
		}
	}
}

func TestHeader(t *testing.T) {
	for _, h := range []frameHeader{
		{typ: frameData, length: 1, tag: 1, offset: 0},
		{typ: frameData, length: maxFrameBytes, tag: ^uint64(0), offset: 1 << 50},
		{typ: frameAbort, tag: 5},
	} {
		got, err := decodeHeader(header(h))
		if err != nil || got != h {
			t.Errorf("%+v: round trip %+v, %v", h, got, err)
		}
	}
	if _, err := decodeHeader(header(frameHeader{typ: frameData, length: 1, offset: 1<<63 - 1})); err == nil {
		t.Error("offset overflow accepted")
	}
	var pre [prefaceLen]byte
	putPreface(pre[:], 77)
	if s, err := decodePreface(pre[:]); err != nil || s != 77 {
		t.Errorf("preface: %d, %v", s, err)
	}
	for _, v := range []byte{1, 3} { // 1: before the receiver's accept
		pre[4] = v
		if _, err := decodePreface(pre[:]); !errors.Is(err, transport.ErrProtocol) {
			t.Errorf("preface of version %d: %v", v, err)
		}
	}
}

func FuzzDecodeDescriptor(f *testing.F) {
	f.Add([]byte(descFormat.Encode(receipt.Descriptor{Endpoint: "127.0.0.1:40000", Tag: 1, Total: 1})))
	f.Add([]byte(descFormat.Encode(receipt.Descriptor{Endpoint: "[::1]:1", Tag: ^uint64(0), Total: 1<<63 - 1})))
	f.Add([]byte{})
	f.Add([]byte{1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := descFormat.Decode(b)
		if err != nil {
			if !errors.Is(err, transport.ErrBadDescriptor) {
				t.Fatalf("error %v does not wrap ErrBadDescriptor", err)
			}
			return
		}
		if d.Tag == 0 || d.Total <= 0 {
			t.Fatalf("accepted %+v", d)
		}
		if !bytes.Equal(descFormat.Encode(d), b) {
			t.Fatalf("re-encoding %+v differs from the input", d)
		}
	})
}

func FuzzDecodeHeader(f *testing.F) {
	f.Add(header(frameHeader{typ: frameData, length: 4 << 20, tag: 3, offset: 8 << 20}))
	f.Add(header(frameHeader{typ: frameAbort, tag: 3}))
	f.Add(make([]byte, headerLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHeader(b)
		if err != nil {
			if !errors.Is(err, transport.ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", err)
			}
			return
		}
		if h.length > maxFrameBytes || (h.typ == frameData && h.length == 0) {
			t.Fatalf("accepted %+v", h)
		}
		if !bytes.Equal(header(h), b) {
			t.Fatalf("re-encoding %+v differs from the input", h)
		}
	})
}
