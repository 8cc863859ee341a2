//go:build linux

package shm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/memfd"
	"github.com/kvxfer/kvxfer/transport"
)

// The test binary, run with childEnv set, is the peer process of the
// cross-process tests (as bench's tests do): a receiver or a sender that
// talks to the parent over stdin and stdout, one line at a time.
const (
	childEnv     = "KVXFER_SHM_CHILD"   // "recv", "recv2", "send", "sendloop", "echo" or spliceRole
	childSizeEnv = "KVXFER_SHM_CHILD_N" // bytes to move
	childHoldEnv = "KVXFER_SHM_HOLD"    // "1": the receiver stops in its first piece
)

// childMain runs the peer process and returns its exit code.
//
// recv: prints "EP <endpoint>" and "DESC <hex>", waits for the bytes (30 s
// at most) and prints "RECV ok" or "RECV <error>". With childHoldEnv, it
// prints "COPYING" in its first piece and stops there until killed.
//
// recv2: as recv, then a second receipt the same way (its own "DESC" and
// "RECV" lines), once the first has ended.
//
// send: reads "DESC <hex>" from stdin, sends the pattern from registered
// shared memory, prints "SEND ok" or "SEND <error>".
//
// echo: prints each line of stdin back (a round trip of two hops between
// the processes, for scale).
//
// sendloop: sends the pattern to each "DESC <hex>" line of stdin, one
// after the other, until stdin ends; prints "SEND <error>" at the first
// failure and stops.
func childMain(role string) int {
	n, err := strconv.Atoi(os.Getenv(childSizeEnv))
	if err != nil || n <= 0 {
		fmt.Fprintf(os.Stderr, "child: bad %s: %q\n", childSizeEnv, os.Getenv(childSizeEnv))
		return 2
	}
	tr, err := Open(context.Background(), transport.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer tr.Close()
	switch role {
	case "recv", "recv2":
		if os.Getenv(childHoldEnv) == "1" {
			var once sync.Once
			hook := func() {
				once.Do(func() { fmt.Println("COPYING") })
				select {} // until killed
			}
			testHookPiece.Store(&hook)
		}
		fmt.Printf("EP %s\n", tr.Endpoint())
		receipts := 1
		if role == "recv2" {
			receipts = 2
		}
		for range receipts {
			if !childRecv(tr, n) {
				return 1
			}
		}
	case "send":
		sa, err := memfd.New(memfdName, n, memfd.Options{})
		if err != nil {
			fmt.Println("SEND", err)
			return 1
		}
		defer sa.Close()
		fill(sa.Bytes(), 42)
		if err := tr.RegisterMemory(sa.Bytes(), sa.File()); err != nil {
			fmt.Println("SEND", err)
			return 1
		}
		line, _ := bufio.NewReader(os.Stdin).ReadString('\n')
		desc, err := hex.DecodeString(strings.TrimSpace(strings.TrimPrefix(line, "DESC ")))
		if err != nil {
			fmt.Println("SEND bad descriptor line", err)
			return 1
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := tr.Send(ctx, desc, [][]byte{sa.Bytes()}); err != nil {
			fmt.Println("SEND", err)
		} else {
			fmt.Println("SEND ok")
		}
		tr.Close() // before the arena
	case "echo":
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			fmt.Println(in.Text())
		}
	case "sendloop":
		src := fill(make([]byte, n), 42)
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			desc, err := hex.DecodeString(strings.TrimPrefix(in.Text(), "DESC "))
			if err == nil {
				err = tr.Send(context.Background(), desc, [][]byte{src})
			}
			if err != nil {
				fmt.Println("SEND", err)
				return 1
			}
		}
	default:
		return 2
	}
	return 0
}

// childRecv arms a receipt of n bytes, prints "DESC <hex>", waits for the
// bytes (30 s at most) and prints "RECV ok" or "RECV <error>". It reports
// false when it could not arm the receipt.
func childRecv(tr *Transport, n int) bool {
	dst := make([]byte, n)
	r, err := tr.Expect([][]byte{dst})
	if err != nil {
		fmt.Println("RECV", err)
		return false
	}
	fmt.Printf("DESC %x\n", r.Descriptor())
	select {
	case <-r.Done():
	case <-time.After(30 * time.Second):
		r.Cancel()
	}
	switch {
	case r.Err() != nil:
		fmt.Println("RECV", r.Err())
	case !bytes.Equal(dst, fill(make([]byte, n), 42)):
		fmt.Println("RECV bytes differ")
	default:
		fmt.Println("RECV ok")
	}
	return true
}

// child is a running peer process.
type child struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string   // its stdout
	done   chan struct{} // closed when its stdout ends
	stderr bytes.Buffer
}

// startChild starts the test binary as a peer of the given role; it is
// killed and reaped at the end of t.
func startChild(t testing.TB, role string, n int, hold bool) *child {
	t.Helper()
	c := &child{lines: make(chan string, 16), done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), childEnv+"="+role, childSizeEnv+"="+strconv.Itoa(n))
	if hold {
		c.cmd.Env = append(c.cmd.Env, childHoldEnv+"=1")
	}
	c.cmd.Stderr = &c.stderr
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := c.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(c.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		c.cmd.Process.Kill()
		for drained := false; !drained; { // so that the scanner can end
			select {
			case <-c.lines:
			case <-c.done:
				drained = true
			}
		}
		c.cmd.Wait()
		if t.Failed() && c.stderr.Len() > 0 {
			t.Logf("child's stderr:\n%s", c.stderr.String())
		}
	})
	return c
}

// line returns the rest of the child's next line that starts with prefix,
// within 30 s.
func (c *child) line(t *testing.T, prefix string) string {
	t.Helper()
	timer := time.NewTimer(30 * time.Second)
	defer timer.Stop()
	for {
		select {
		case l := <-c.lines:
			if rest, ok := strings.CutPrefix(l, prefix); ok {
				return strings.TrimSpace(rest)
			}
			t.Logf("child: %s", l)
		case <-c.done:
			for {
				select {
				case l := <-c.lines:
					if rest, ok := strings.CutPrefix(l, prefix); ok {
						return strings.TrimSpace(rest)
					}
				default:
					t.Fatalf("child ended without a %q line; stderr:\n%s", prefix, c.stderr.String())
				}
			}
		case <-timer.C:
			t.Fatalf("no %q line from the child after 30 s", prefix)
		}
	}
}

// kill kills the child and waits for it to be gone.
func (c *child) kill(t *testing.T) {
	t.Helper()
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	c.cmd.Process.Wait()
}

// TestCrossProcess: transfers to and from another process, and a Probe of
// it.
func TestCrossProcess(t *testing.T) {
	const n = 64<<20 + 5
	t.Run("to child", func(t *testing.T) {
		a := open(t, transport.Options{})
		src := fill(shared(t, n, a), 42)
		c := startChild(t, "recv", n, false)
		ep := c.line(t, "EP ")
		desc, err := hex.DecodeString(c.line(t, "DESC "))
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Probe(context.Background(), ep); err != nil {
			t.Fatalf("Probe(child): %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := a.Send(ctx, desc, [][]byte{src[:n/2], src[n/2:]}); err != nil {
			t.Fatalf("Send to the child: %v", err)
		}
		if got := c.line(t, "RECV "); got != "ok" {
			t.Fatalf("child: RECV %s", got)
		}
	})
	t.Run("from child", func(t *testing.T) {
		b := open(t, transport.Options{})
		dst := make([]byte, n)
		r, err := b.Expect([][]byte{dst[:7], dst[7:]})
		if err != nil {
			t.Fatal(err)
		}
		c := startChild(t, "send", n, false)
		fmt.Fprintf(c.stdin, "DESC %x\n", r.Descriptor())
		if got := c.line(t, "SEND "); got != "ok" {
			t.Fatalf("child: SEND %s", got)
		}
		within(t, 10*time.Second, "Recv", func() { <-r.Done() })
		if r.Err() != nil {
			t.Fatal(r.Err())
		}
		if !bytes.Equal(dst, fill(make([]byte, n), 42)) {
			t.Fatal("bytes differ")
		}
	})
}

// TestPeerKilled: a peer process killed in the middle of a transfer fails
// it on this side with ErrPeerLost, promptly, and this side goes on.
func TestPeerKilled(t *testing.T) {
	const n = 64 << 20
	t.Run("receiver", func(t *testing.T) {
		a, b := open(t, transport.Options{}), open(t, transport.Options{})
		src := fill(shared(t, n, a), 42)
		c := startChild(t, "recv", n, true)
		desc, err := hex.DecodeString(c.line(t, "DESC "))
		if err != nil {
			t.Fatal(err)
		}
		res := make(chan error, 1)
		go func() { res <- a.Send(context.Background(), desc, [][]byte{src}) }()
		c.line(t, "COPYING")
		c.kill(t)
		var err2 error
		within(t, 5*time.Second, "Send to a killed receiver", func() { err2 = <-res })
		if !errors.Is(err2, transport.ErrPeerLost) {
			t.Errorf("Send = %v, want ErrPeerLost", err2)
		}
		t.Log(err2)
		healthy(t, a, b, src[:1<<20])
	})
	t.Run("sender", func(t *testing.T) {
		a, b := open(t, transport.Options{}), open(t, transport.Options{})
		release := make(chan struct{})
		hook, holding := holdFirst(release)
		setHook(t, hook)
		r, err := b.Expect([][]byte{make([]byte, n)})
		if err != nil {
			t.Fatal(err)
		}
		c := startChild(t, "send", n, false)
		fmt.Fprintf(c.stdin, "DESC %x\n", r.Descriptor())
		within(t, 30*time.Second, "the copy to start", func() { <-holding })
		c.kill(t)
		close(release) // the copy goes on from memory that outlives its process
		within(t, 5*time.Second, "Recv from a killed sender", func() { <-r.Done() })
		if !errors.Is(r.Err(), transport.ErrPeerLost) {
			t.Errorf("Recv.Err = %v, want ErrPeerLost", r.Err())
		}
		t.Log(r.Err())
		healthy(t, a, b, shared(t, 1<<20, a))
	})
}
