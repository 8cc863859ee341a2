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

// inClose counts this process's goroutines in a close(2) of a
// descriptor a peer sent: on goroutines of their own (closeReceived's),
// and on connections' readers.
func inClose() (own, readers int) {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		switch {
		case strings.Contains(g, "shm.closeReceived.func"):
			own++
		case strings.Contains(g, "shm.closeReceived("):
			readers++
		}
	}
	return own, readers
}

// TestHostileBlockingDescriptors: a local process sends, over many
// connections, a descriptor of a file whose close blocks (FUSE, its flush
// held): as the window of a connection (once with the descriptor twice),
// and with messages after a window. Before, the receiver took every
// descriptor and closed each on a goroutine of its own that stayed blocked
// for as long as the peer liked, without bound (120 for these
// connections). Now a receiver takes one descriptor per connection, with
// its WINDOW, and a sender none (the kernel drops the others without
// installing them, so nothing closes them); at most maxStuckCloses closes
// run on goroutines of their own, the others on the readers of the
// attacker's own connections; and new senders connect and transfer
// throughout.
func TestHostileBlockingDescriptors(t *testing.T) {
	root, f := mountBlocking(t)
	defer root.open() // before the Transports' cleanups, which wait for their readers
	fd := int(f.Fd())
	a, b := open(t, transport.Options{}), open(t, transport.Options{})
	src := fill(shared(t, 1<<20, a), 9)
	healthy(t, a, b, src)

	const conns = 48
	windows := 0 // connections whose window is the blocking file
	for i := range conns {
		nc, _ := rawConn(t, b)
		// Write errors are the receiver closing the connection at the
		// first descriptor it refuses: what is checked is what it did.
		switch {
		case i == 0:
			// The descriptor twice with the window: the kernel installs one.
			writeFull(nc, appendMsg(nil, &msg{typ: msgWindow, slotLen: 4096, slots: 1}), syscall.UnixRights(fd, fd))
			windows++
		case i%2 == 0:
			// The descriptor as the window.
			sendFd(nc, &msg{typ: msgWindow, slotLen: 4096, slots: 1}, fd)
			windows++
		default:
			// A proper window, then the descriptor with later messages.
			announce(t, nc, testArena(t, 4096+ringLen(1)), 4096, 1)
			for range 4 {
				sendFd(nc, &msg{typ: msgAbort, tag: uint64(1000 + i)}, fd)
			}
		}
		expectClosedOrOpen(nc)
		nc.Close()
	}
	eventually(t, "a close of each window's descriptor", func() bool { return root.flushes.Load() >= int64(windows) })
	time.Sleep(200 * time.Millisecond) // for any close more, which would be a defect
	own, readers := inClose()
	t.Logf("%d connections: %d flushes of the blocking file, %d closes blocked on goroutines of their own, %d on readers", conns, root.flushes.Load(), own, readers)
	if n := root.flushes.Load(); n != int64(windows) {
		t.Errorf("%d closes of the blocking file began, want %d (one per window; descriptors after a window, or a second with it, are dropped by the kernel uninstalled)", n, windows)
	}
	if own > maxStuckCloses {
		t.Errorf("%d goroutines of their own blocked closing peers' descriptors, want at most %d", own, maxStuckCloses)
	}
	healthy(t, a, b, src) // a connection that has its window goes on
	// A sender that connects now gets its window taken and transfers.
	c := open(t, transport.Options{})
	healthy(t, c, b, fill(shared(t, 1<<20, c), 4))

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
	eventually(t, "the blocked closes to end", func() bool { own, readers := inClose(); return own+readers == 0 })
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
