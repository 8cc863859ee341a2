//go:build linux

package shm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/memfd"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// TestHostileReceiverGetsOnlyItsBytes is the regression test of the pool
// grab (issue #10): a receiver that a sender dials (anyone who can hand the
// sender a descriptor, e.g. a client that poses as a generation rank with
// the token of its own request) must get the bytes of its own Sends, read
// only, and nothing else: no descriptor of the sender's pool or staging
// memory, no way to write into what it is given.
func TestHostileReceiverGetsOnlyItsBytes(t *testing.T) {
	a := open(t, transport.Options{})
	// The sender's pool: other users' KV cache (the canary byte) around the
	// attacker's own request. Registered, as the transceiver registers its
	// pools: registration must not make it reachable.
	const poolLen = 4 << 20
	pool := shared(t, poolLen, a)
	for i := range pool {
		pool[i] = 0xc5
	}
	own := pool[1<<20 : 1<<20+3<<20/2] // 1.5 MiB: several parts, the last one short
	for i := range own {
		own[i] = byte(i % 197) // never 0xc5 (197)
	}

	type result struct {
		fds      int
		size     int64
		writable []string // the ways of writing that worked
		window   []byte   // the window's content at the end
		got      []byte   // the bytes of the parts, in order
		err      error
	}
	res := make(chan result, 1)
	ep := rawListener(t, func(c net.Conn) {
		nc := c.(*net.UnixConn)
		out := result{}
		defer func() { res <- out }()
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		r, err := acceptRaw(nc)
		if err != nil {
			out.err = err
			return
		}
		defer r.close()
		out.fds, out.size, out.writable = r.fds, r.size, r.writable
		for {
			m, err := r.next()
			if err != nil {
				out.err = err
				return
			}
			switch m.typ {
			case msgRead:
				at := int(m.slot) * r.slotLen
				out.got = append(out.got, r.win[at:at+int(m.length)]...)
				writeFull(nc, appendMsg(nil, &msg{typ: msgRelease, slot: m.slot}), nil)
				if m.last {
					out.window = bytes.Clone(r.win)
					writeFull(nc, appendMsg(nil, &msg{typ: msgDone, op: m.op}), nil)
					return
				}
			default:
				out.err = fmt.Errorf("unexpected message %+v", m)
				return
			}
		}
	})
	d := receipt.Descriptor{Endpoint: ep, Tag: 42, Total: int64(len(own))}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.Send(ctx, descFormat.Encode(d), [][]byte{own}); err != nil {
		t.Fatalf("Send to the hostile receiver: %v", err)
	}
	out := <-res
	if out.err != nil {
		t.Fatalf("hostile receiver: %v", out.err)
	}
	if out.fds != 1 {
		t.Errorf("the receiver got %d descriptors, want 1 (the window)", out.fds)
	}
	if want := int64(windowSlots*maxSlotLen + ringLen(windowSlots)); out.size != want {
		t.Errorf("the descriptor the receiver got is a file of %d bytes, want the %d-byte window", out.size, want)
	}
	if len(out.writable) > 0 {
		t.Errorf("the receiver could write the sender's window: %v", out.writable)
	}
	if !bytes.Equal(out.got, own) {
		t.Error("the receiver did not get exactly its own bytes")
	}
	if i := bytes.IndexByte(out.window, 0xc5); i >= 0 {
		t.Errorf("the window holds a byte of other requests at %d", i)
	}
	healthy(t, a, open(t, transport.Options{}), pool[:1<<20])
}

// rawReceiver is a receiver played by a test: it has read the HELLO and
// the WINDOW of a sender, and mapped the window read-only.
type rawReceiver struct {
	nc       *net.UnixConn
	mr       *msgReader
	win      []byte // the whole file: slots, then the ring
	slotLen  int
	slots    int
	taken    uint64   // parts taken from the ring
	fds      int      // descriptors that came with the WINDOW
	size     int64    // of the window's file
	writable []string // the ways of writing the window that worked (tryWrite)
}

// acceptRaw answers the HELLO on nc and maps the window the sender
// announces.
func acceptRaw(nc *net.UnixConn) (*rawReceiver, error) {
	r := &rawReceiver{nc: nc, mr: newMsgReader(nc)}
	r.mr.want = 1 // the window's memory file
	if m, err := r.mr.next(); err != nil || m.typ != msgHello {
		r.mr.closeFds()
		return nil, fmt.Errorf("hello: %+v, %v", m, err)
	}
	writeFull(nc, appendMsg(nil, &msg{typ: msgHello, version: protoVersion}), nil)
	m, err := r.mr.next()
	if err != nil || m.typ != msgWindow {
		r.mr.closeFds()
		return nil, fmt.Errorf("window: %+v, %v", m, err)
	}
	r.fds, r.slotLen, r.slots = len(r.mr.fds), int(m.slotLen), int(m.slots)
	fd, _ := r.mr.takeFd()
	f := os.NewFile(uintptr(fd), "window")
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		r.mr.closeFds()
		return nil, err
	}
	r.size = st.Size()
	r.writable = tryWrite(f, int(r.size))
	if r.win, err = syscall.Mmap(fd, 0, int(r.size), syscall.PROT_READ, syscall.MAP_SHARED); err != nil {
		r.mr.closeFds()
		return nil, err
	}
	return r, nil
}

// next returns the next part posted in the ring (type msgRead) or, when
// there is none, says IDLE and returns the next message but POST.
func (r *rawReceiver) next() (msg, error) {
	ring := r.win[r.slots*r.slotLen:]
	for {
		if n := (*atomic.Uint64)(unsafe.Pointer(&ring[0])).Load(); r.taken < n {
			at := ringHdr + int(r.taken%uint64(r.slots))*readLen
			r.taken++
			return decodeEntry(bytes.Clone(ring[at : at+readLen]))
		}
		writeFull(r.nc, appendMsg(nil, &msg{typ: msgIdle, seq: r.taken}), nil)
		m, err := r.mr.next()
		if err != nil || m.typ != msgPost {
			return m, err
		}
	}
}

func (r *rawReceiver) close() {
	syscall.Munmap(r.win)
	r.mr.closeFds()
}

// tryWrite tries every way a holder of f could write the memory behind it,
// and returns those that worked.
func tryWrite(f *os.File, size int) []string {
	var ok []string
	fd := int(f.Fd())
	if b, err := syscall.Mmap(fd, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED); err == nil {
		ok = append(ok, "mmap PROT_WRITE")
		syscall.Munmap(b)
	}
	if _, err := syscall.Pwrite(fd, []byte{1}, 0); err == nil {
		ok = append(ok, "pwrite")
	}
	if err := syscall.Ftruncate(fd, 0); err == nil {
		ok = append(ok, "ftruncate")
	}
	// Reopening through /proc gets a new open file description with write
	// access: the seal must hold against it too.
	if g, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", fd), os.O_RDWR, 0); err == nil {
		if _, err := g.WriteAt([]byte{1}, 0); err == nil {
			ok = append(ok, "write through /proc/self/fd")
		}
		if b, err := syscall.Mmap(int(g.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED); err == nil {
			ok = append(ok, "mmap PROT_WRITE through /proc/self/fd")
			syscall.Munmap(b)
		}
		g.Close()
	}
	// A private writable mapping writes only the receiver's own copy: it
	// is not a way to write the sender's memory, and is allowed.
	return ok
}

// TestWindowMustBeSealed: a window that its sender could still write
// through another descriptor is not mapped; the receiver says why.
func TestWindowMustBeSealed(t *testing.T) {
	b := open(t, transport.Options{})
	nc, mr := rawConn(t, b)
	plain, err := memfd.New(memfdName, 4096+ringLen(1), memfd.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	announce(t, nc, plain, 4096, 1)
	writeMsgs(t, nc, &msg{typ: msgProbe, op: 1})
	if m := readMsg(t, nc, mr); m.typ != msgErr || m.code != codeRegion || !strings.Contains(m.text, "sealed against writes") {
		t.Fatalf("answer to a probe of an unsealed window: %+v", m)
	}
}

// TestHostileReceiverAnswers: a receiver that breaks the protocol (releases
// a slot it was never sent, answers DONE before the last part) or stalls
// (never releases a slot) fails that Send within its ctx and the grace
// period, and the sender goes on serving others.
func TestHostileReceiverAnswers(t *testing.T) {
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	// Slots are taken first-freed first, from slot 0: three parts fill slots
	// 0..2, and a window and four more cannot all go out while nothing is
	// released.
	many := windowSlots + 4
	for _, tc := range []struct {
		name  string
		parts int
		after func(nc *net.UnixConn, first msg) // run at the first READ
		want  error
	}{
		{"release of a slot never sent", 3, func(nc *net.UnixConn, first msg) {
			writeFull(nc, appendMsg(nil, &msg{typ: msgRelease, slot: first.slot + 5}), nil)
		}, transport.ErrProtocol},
		{"done before the last part", many, func(nc *net.UnixConn, first msg) {
			writeFull(nc, appendMsg(nil, &msg{typ: msgDone, op: first.op}), nil)
		}, transport.ErrProtocol},
		{"idle past the parts posted", 3, func(nc *net.UnixConn, first msg) {
			writeFull(nc, appendMsg(nil, &msg{typ: msgIdle, seq: 1000}), nil)
		}, transport.ErrProtocol},
		{"never releases", many, func(*net.UnixConn, msg) {}, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := fill(make([]byte, tc.parts*maxSlotLen), 8)
			ep := rawListener(t, func(c net.Conn) {
				nc := c.(*net.UnixConn)
				nc.SetDeadline(time.Now().Add(10 * time.Second))
				r, err := acceptRaw(nc)
				if err != nil {
					return
				}
				defer r.close()
				for first := true; ; {
					m, err := r.next()
					if err != nil {
						return
					}
					if m.typ == msgRead && first {
						first = false
						tc.after(nc, m)
					}
				}
			})
			d := receipt.Descriptor{Endpoint: ep, Tag: 9, Total: int64(len(src))}
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			err := a.Send(ctx, descFormat.Encode(d), [][]byte{src})
			if !errors.Is(err, tc.want) {
				t.Errorf("Send = %v, want %v", err, tc.want)
			}
			if took := time.Since(start); took > 300*time.Millisecond+2*grace {
				t.Errorf("Send returned after %v", took)
			}
			move(t, a, b, [][]byte{src}, [][]byte{make([]byte, len(src))})
		})
	}
}

// TestWindowRefused: a receiver that cannot map the window answers it ERR
// for op 0; the Send fails at once with ErrRefused, saying why.
func TestWindowRefused(t *testing.T) {
	a := open(t, transport.Options{})
	ep := rawListener(t, func(c net.Conn) {
		nc := c.(*net.UnixConn)
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		r, err := acceptRaw(nc)
		if err != nil {
			return
		}
		defer r.close()
		writeFull(nc, appendMsg(nil, &msg{typ: msgErr, code: codeRegion, text: "no room"}), nil)
		r.mr.next() // until the sender closes
	})
	d := receipt.Descriptor{Endpoint: ep, Tag: 5, Total: 100}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := a.Send(ctx, descFormat.Encode(d), [][]byte{make([]byte, 100)})
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "no room") || ctx.Err() != nil {
		t.Fatalf("Send = %v, want ErrRefused with the receiver's reason, before its deadline", err)
	}
}
