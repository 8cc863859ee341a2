package serve

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"
)

// TestHostileHeaderFlood: a client that sends a megabyte of header lines
// and never ends them. net/http keeps up to its MaxHeaderBytes (1 MiB by
// default) of headers per connection while it waits for the rest, for
// ReadHeaderTimeout (10 s), on each of up to MaxConns (4,096) connections,
// and any local process can open them from 127.0.0.2, 127.0.0.3, ... past
// the per-host cap: gigabytes of a worker's or the router's heap. The
// headers are bounded at MaxHeaderBytes (64 KiB): past it the server
// answers 431 and closes the connection, and the heap holds a few
// kilobytes per connection.
func TestHostileHeaderFlood(t *testing.T) {
	const (
		conns  = 64
		padded = 1 << 20 // header bytes each connection sends
	)
	addr := serveWorker(t, HTTPLimits{})
	before := heapAlloc()
	line := "X-Pad: " + strings.Repeat("a", 1017) + "\r\n" // 1 KiB a line
	held := flood(t, addr, conns, func(c net.Conn) {
		c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: worker\r\n"); err != nil {
			return
		}
		for n := 0; n < padded; n += len(line) {
			if _, err := io.WriteString(c, line); err != nil {
				return // the server closed it: what it should do
			}
		}
	})
	// The server has read what it is going to read once it has answered
	// or stopped reading; give it a moment to get there either way.
	time.Sleep(500 * time.Millisecond)
	grown := int64(heapAlloc()) - int64(before)
	t.Logf("%d connections holding %d KiB of unfinished headers each: heap %+d KiB", conns, padded>>10, grown>>10)
	if limit := int64(conns) << 18; grown > limit { // 256 KiB a connection
		t.Errorf("the heap grew %d MiB for %d connections with unfinished headers, want at most %d MiB",
			grown>>20, conns, limit>>20)
	}
	// Every connection has been ended by the server (431 and close), not
	// left waiting for the rest of its headers (ReadHeaderTimeout, 10 s,
	// is not what ends them: each is given 2 s from now).
	var ended sync.WaitGroup
	var open atomic.Int32
	for _, c := range held {
		if c == nil {
			continue
		}
		ended.Go(func() {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			b, err := io.ReadAll(io.LimitReader(c, 4096))
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				open.Add(1)
				return
			}
			if len(b) > 0 && !strings.HasPrefix(string(b), "HTTP/1.1 431") {
				t.Errorf("a connection with 1 MiB of headers was answered %q", strings.SplitN(string(b), "\r\n", 2)[0])
			}
		})
	}
	ended.Wait()
	if n := open.Load(); n > 0 {
		t.Errorf("%d of %d connections with 1 MiB of unfinished headers were still open, the server waiting for more", n, conns)
	}
	// A client that sends ordinary headers is served.
	resp, err := http.Get("http://" + addr + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/health after the flood: %s", resp.Status)
	}
}

// TestHostileBodyFlood: clients that each send a body of MaxBody (8 MiB)
// less its last byte and stall. Each handler's body grew to what had come,
// until the body timeout (1 min): on up to MaxConns (4,096) connections,
// which any local process can open from 127.0.0.2, 127.0.0.3, ... past the
// per-host cap, that is 32 GiB and more, past this machine's memory. The
// bodies being received past their first FreeBodyBytes now share a budget
// (HTTPLimits.BodyBudget): a body that would go over it is refused with
// 503, and small requests are served all along.
func TestHostileBodyFlood(t *testing.T) {
	const (
		conns  = 24
		budget = 32 << 20
	)
	addr := serveWorker(t, HTTPLimits{BodyBudget: budget})
	before := heapAlloc()
	chunk := []byte(strings.Repeat(" ", 64<<10))
	held := flood(t, addr, conns, func(c net.Conn) {
		c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", MaxBody); err != nil {
			return
		}
		for n := 0; n < MaxBody-len(chunk); n += len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				return // refused and closed
			}
		}
	})
	time.Sleep(500 * time.Millisecond)
	grown := int64(heapAlloc()) - int64(before)
	t.Logf("%d connections stalled near the end of an 8 MiB body: heap %+d MiB (budget %d MiB)", conns, grown>>20, budget>>20)
	if limit := int64(budget + conns*FreeBodyBytes + 16<<20); grown > limit {
		t.Errorf("the heap grew %d MiB for %d stalled bodies, want at most %d MiB", grown>>20, conns, limit>>20)
	}
	// Small requests are served during the flood.
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"tiny-gqa","prompt":"hello","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a small completion during the flood: %s", resp.Status)
	}
	// The bodies over the budget were refused with 503, at once.
	var refused atomic.Int32
	var answered sync.WaitGroup
	for _, c := range held {
		if c == nil {
			continue
		}
		answered.Go(func() {
			c.SetReadDeadline(time.Now().Add(time.Second))
			b := make([]byte, 64)
			n, _ := io.ReadAtLeast(c, b, 12)
			if strings.HasPrefix(string(b[:n]), "HTTP/1.1 503") {
				refused.Add(1)
			}
		})
	}
	answered.Wait()
	if min := conns - budget/MaxBody - 1; int(refused.Load()) < min {
		t.Errorf("%d of %d bodies over the budget were refused with 503, want at least %d", refused.Load(), conns, min)
	}
}

// serveWorker serves a tiny-gqa worker (both roles) on loopback with the
// limits lim until the test ends, and returns its address.
func serveWorker(t *testing.T, lim HTTPLimits) string {
	t.Helper()
	w, err := NewWorker(context.Background(), WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		w.Close()
		t.Fatal(err)
	}
	srv := NewHTTPServer(w.Handler(), lim)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(LimitListener(ln, "worker http", lim, nil, nil)) }()
	t.Cleanup(func() {
		srv.Close()
		<-served
		w.Close()
	})
	return ln.Addr().String()
}

// heapAlloc returns the bytes of live heap objects, after a collection.
func heapAlloc() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// flood opens n connections to addr at once and runs send on each; it
// returns them (nil where the dial failed, which fails the test), closed
// when the test ends.
func flood(t *testing.T, addr string, n int, send func(net.Conn)) []net.Conn {
	t.Helper()
	held := make([]net.Conn, n)
	var wg sync.WaitGroup
	for i := range held {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", addr, 5*time.Second)
			if err != nil {
				t.Error(err)
				return
			}
			held[i] = c
			send(c)
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range held {
			if c != nil {
				c.Close()
			}
		}
	})
	return held
}

// TestReadAll checks readAll against io.ReadAll over sizes around its chunk
// boundaries and readers that return little at a time or data with their
// error, and that a body still coming holds little more than what came.
func TestReadAll(t *testing.T) {
	src := make([]byte, 5*budgetChunk+300)
	for i := range src {
		src[i] = byte(i * 7)
	}
	readers := map[string]func([]byte) io.Reader{
		"plain":    func(b []byte) io.Reader { return bytes.NewReader(b) },
		"one byte": func(b []byte) io.Reader { return iotest.OneByteReader(bytes.NewReader(b)) },
		"half":     func(b []byte) io.Reader { return iotest.HalfReader(bytes.NewReader(b)) },
		"data+EOF": func(b []byte) io.Reader { return iotest.DataErrReader(bytes.NewReader(b)) },
	}
	for _, n := range []int{0, 1, 511, 512, 513, budgetChunk - 1, budgetChunk, budgetChunk + 1, 2 * budgetChunk, len(src)} {
		for name, mk := range readers {
			if name == "one byte" && n > 2*budgetChunk {
				continue
			}
			got, err := readAll(mk(src[:n]))
			want, _ := io.ReadAll(mk(src[:n]))
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("%s, %d bytes: got %d bytes, err %v; want the %d bytes io.ReadAll reads", name, n, len(got), err, len(want))
			}
		}
	}
	// An error other than EOF is returned, the bytes before it are not.
	boom := errors.New("boom")
	if got, err := readAll(io.MultiReader(bytes.NewReader(src[:1000]), iotest.ErrReader(boom))); !errors.Is(err, boom) || got != nil {
		t.Fatalf("error after 1000 bytes: got %d bytes, %v; want none and boom", len(got), err)
	}
	// A body that has sent n bytes and stalls holds about n bytes:
	// io.ReadAll (Go 1.26) holds up to half as much again, in a chunk made
	// for what is still to come.
	for _, n := range []int{1_200_000, 1_400_000, 1_600_000, 1_800_000} {
		pr, pw := io.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			readAll(pr)
		}()
		before := heapAlloc()
		pw.Write(make([]byte, n))
		grown := int64(heapAlloc()) - int64(before)
		pw.CloseWithError(boom)
		<-done
		if limit := int64(n + 2*budgetChunk); grown > limit {
			t.Errorf("a body that sent %d bytes and stalled holds %d bytes, want at most %d", n, grown, limit)
		}
	}
}
