//go:build linux

package shm

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// blockingRoot is a FUSE file system of one file, "f", whose close(2)
// blocks (in FUSE's flush) until gate is closed: a file a hostile local
// process can make, and send over a Unix socket, when it may mount FUSE.
type blockingRoot struct {
	fs.Inode
	gate     chan struct{}
	gateOnce sync.Once
	flushes  atomic.Int64 // flushes begun
}

// open lets every flush, blocked or to come, go on.
func (r *blockingRoot) open() { r.gateOnce.Do(func() { close(r.gate) }) }

func (r *blockingRoot) OnAdd(ctx context.Context) {
	f := r.NewPersistentInode(ctx, &blockingFile{root: r}, fs.StableAttr{Mode: syscall.S_IFREG})
	r.AddChild("f", f, false)
}

type blockingFile struct {
	fs.Inode
	root *blockingRoot
}

func (f *blockingFile) Open(context.Context, uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (f *blockingFile) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	return 0
}

func (f *blockingFile) Flush(context.Context, fs.FileHandle) syscall.Errno {
	f.root.flushes.Add(1)
	<-f.root.gate
	return 0
}

// mountBlocking mounts a blockingRoot and opens its file; it skips t
// where FUSE cannot be mounted (not root, no /dev/fuse). The gate opens,
// the file closes and the file system unmounts at the end of t.
func mountBlocking(t *testing.T) (*blockingRoot, *os.File) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE here needs root (mount(2) without fusermount)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no FUSE on this machine: %v", err)
	}
	root := &blockingRoot{gate: make(chan struct{})}
	dir := t.TempDir()
	srv, err := fs.Mount(dir, root, &fs.Options{MountOptions: fuse.MountOptions{
		DirectMountStrict: true, Name: "kvxfer-shm-test", DisableXAttrs: true}})
	if err != nil {
		t.Skipf("cannot mount FUSE here: %v", err)
	}
	var f *os.File
	// One cleanup, registered after TempDir's (so it runs before the
	// directory's removal), in this order: every close of the file
	// blocks until the gate opens, this test's own included.
	t.Cleanup(func() {
		root.open()
		if f != nil {
			f.Close()
		}
		srv.Unmount()
	})
	if f, err = os.Open(filepath.Join(dir, "f")); err != nil {
		t.Fatal(err)
	}
	return root, f
}

// sendFd writes m over nc with fd attached (SCM_RIGHTS).
func sendFd(nc *net.UnixConn, m *msg, fd int) error {
	return writeFull(nc, appendMsg(nil, m), syscall.UnixRights(fd))
}

// stuckInClose counts this process's goroutines that are in a close(2) of
// a descriptor a peer sent.
func stuckInClose() int {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "closeReceived") || strings.Contains(g, "unix.Close(") && strings.Contains(g, "transport/shm") {
			n++
		}
	}
	return n
}

// TestHostileBlockingDescriptors: a local process sends, over many
// connections, a descriptor of a file whose close blocks (FUSE, its flush
// held): as the window of each connection, and with messages after a
// window. Before, the receiver closed each on a goroutine of its own that
// stayed blocked for as long as the peer liked, one per descriptor, without
// bound. Now descriptors are taken only with the WINDOW (one per
// connection), at most maxStuckCloses of their closes may be in flight, and
// legitimate transfers go on throughout. A hostile receiver's descriptors
// never reach a sender at all.
func TestHostileBlockingDescriptors(t *testing.T) {
	root, f := mountBlocking(t)
	fd := int(f.Fd())
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	src := fill(shared(t, 1<<20, a), 9)
	healthy(t, a, b, src)

	const conns = 48
	for i := range conns {
		nc, _ := rawConn(t, b)
		// Write errors are the receiver closing the connection at the
		// first descriptor it refuses: what is checked is what it did.
		if i%2 == 0 {
			// The descriptor as the window.
			sendFd(nc, &msg{typ: msgWindow, slotLen: 4096, slots: 1}, fd)
		} else {
			// A proper window, then the descriptor with later messages.
			announce(t, nc, testArena(t, 4096+ringLen(1)), 4096, 1)
			for range 4 {
				sendFd(nc, &msg{typ: msgAbort, tag: uint64(1000 + i)}, fd)
			}
		}
		expectClosedOrOpen(nc)
		nc.Close()
	}
	// Every connection has been handled (or is being torn down): what is
	// stuck now stays stuck until the gate opens.
	time.Sleep(200 * time.Millisecond)
	if n := stuckInClose(); n > maxStuckCloses {
		t.Errorf("%d goroutines blocked closing peers' descriptors after %d connections, want at most %d", n, conns, maxStuckCloses)
	}
	if n := root.flushes.Load(); n > maxStuckCloses {
		t.Errorf("%d closes of the blocking file began, want at most %d (descriptors after the window are refused by the kernel, never installed)", n, maxStuckCloses)
	}
	healthy(t, a, b, src) // legitimate transfers go on
	t.Logf("%d connections, %d flushes of the blocking file, %d goroutines in close", conns, root.flushes.Load(), stuckInClose())

	// A receiver that sends the file to a sender: the sender takes no
	// descriptor.
	before := root.flushes.Load()
	ep := rawListener(t, func(c net.Conn) {
		uc := c.(*net.UnixConn)
		mr := newMsgReader(uc)
		if m, err := mr.next(); err != nil || m.typ != msgHello {
			return
		}
		writeFull(uc, appendMsg(nil, &msg{typ: msgHello, version: protoVersion}), syscall.UnixRights(fd))
		mr.next() // the WINDOW
		writeFull(uc, appendMsg(nil, &msg{typ: msgIdle}), syscall.UnixRights(fd))
		time.Sleep(100 * time.Millisecond)
	})
	d := receipt.Descriptor{Endpoint: ep, Tag: 5, Total: 4096}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	a.Send(ctx, descFormat.Encode(d), [][]byte{src[:4096]}) // fails: no answer; what matters is the descriptors
	time.Sleep(100 * time.Millisecond)
	if n := root.flushes.Load() - before; n != 0 {
		t.Errorf("the sender closed %d descriptors a receiver sent, want 0 (it takes none)", n)
	}

	root.open()
	eventually(t, "the blocked closes to end", func() bool { return stuckInClose() == 0 })
}

// expectClosedOrOpen waits briefly for the receiver to act on what was
// sent (it closes a connection whose window is not shared memory).
func expectClosedOrOpen(nc *net.UnixConn) {
	nc.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	var b [64]byte
	for {
		if _, err := nc.Read(b[:]); err != nil {
			return
		}
	}
}
