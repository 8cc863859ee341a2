package kvcache

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/memfd"
)

// mappings returns the lines of /proc/self/maps that contain substr, or
// that cover address addr if substr is empty.
func mappings(t *testing.T, substr string, addr uintptr) []string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if substr != "" {
			if strings.Contains(line, substr) {
				lines = append(lines, line)
			}
			continue
		}
		var lo, hi uintptr
		if _, err := fmt.Sscanf(line, "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
			lines = append(lines, line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return lines
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

func TestMmapCloseUnmaps(t *testing.T) {
	a, err := MmapAllocator{}.Allocate(3 << 20)
	if err != nil {
		t.Fatal(err)
	}
	addr := addrOf(a.Bytes())
	if len(mappings(t, "", addr)) != 1 {
		t.Fatalf("arena at %#x not in /proc/self/maps", addr)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got := mappings(t, "", addr); len(got) != 0 {
		t.Errorf("arena at %#x still mapped after Close: %v", addr, got)
	}
}

func TestShmShared(t *testing.T) {
	name := fmt.Sprintf("kvcache-test-%d", os.Getpid())
	const size = 1 << 20
	a, err := ShmAllocator{Name: name}.Allocate(size)
	if err != nil {
		t.Fatal(err)
	}
	sa := a.(*ShmArena)
	if sa.File() == nil || sa.Size() != size {
		t.Fatalf("File %v, Size %d", sa.File(), sa.Size())
	}
	peer, err := MapShared(sa.File(), sa.Size())
	if err != nil {
		t.Fatal(err)
	}
	if peer.(*ShmArena).File() != nil {
		t.Error("MapShared arena has a File")
	}
	if got := len(mappings(t, "/memfd:"+name, 0)); got != 2 {
		t.Errorf("%d mappings of the memfd, want 2", got)
	}
	mine, theirs := a.Bytes(), peer.Bytes()
	if addrOf(mine) == addrOf(theirs) {
		t.Fatal("MapShared returned the same mapping")
	}
	copy(mine[100:], "from the owner")
	copy(theirs[size-10:], "from peer")
	if string(theirs[100:114]) != "from the owner" || string(mine[size-10:size-1]) != "from peer" {
		t.Error("writes are not visible through both mappings")
	}

	// Closing the owner unmaps and closes its descriptor; the peer's
	// mapping keeps the memory alive.
	f := sa.File()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Stat(); !errors.Is(err, os.ErrClosed) {
		t.Errorf("file after Close: Stat = %v, want ErrClosed", err)
	}
	if sa.File() != nil || sa.Size() != size {
		t.Errorf("after Close: File %v, Size %d", sa.File(), sa.Size())
	}
	if got := len(mappings(t, "/memfd:"+name, 0)); got != 1 {
		t.Errorf("%d mappings of the memfd after the owner's Close, want 1", got)
	}
	if string(theirs[100:114]) != "from the owner" {
		t.Error("peer lost the data when the owner closed")
	}
	if err := peer.Close(); err != nil {
		t.Fatal(err)
	}
	if got := mappings(t, "/memfd:"+name, 0); len(got) != 0 {
		t.Errorf("memfd still mapped after both Close: %v", got)
	}
	if err := peer.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestShmOverUnixSocket passes a pool's memory file the way the shm backend
// does (SCM_RIGHTS) and has the "peer" write into one block.
func TestShmOverUnixSocket(t *testing.T) {
	p, err := NewPool(testLayout, 4, ShmAllocator{})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	sa, ok := p.Arena().(*ShmArena)
	if !ok {
		t.Fatalf("arena is %T", p.Arena())
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	rc, err := sa.File().SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var sendErr error
	if err := rc.Control(func(fd uintptr) {
		sendErr = syscall.Sendmsg(fds[0], []byte("x"), syscall.UnixRights(int(fd)), nil, 0)
	}); err != nil || sendErr != nil {
		t.Fatal(err, sendErr)
	}
	buf, oob := make([]byte, 1), make([]byte, syscall.CmsgSpace(4))
	_, oobn, _, _, err := syscall.Recvmsg(fds[1], buf, oob, syscall.MSG_CMSG_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatal(msgs, err)
	}
	rfds, err := syscall.ParseUnixRights(&msgs[0])
	if err != nil || len(rfds) != 1 {
		t.Fatal(rfds, err)
	}
	received := os.NewFile(uintptr(rfds[0]), "received")
	peer, err := MapShared(received, sa.Size())
	received.Close() // the mapping does not need it
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()

	ids, _ := p.Allocate(2)
	off := p.BlockOffset(ids[1])
	copy(peer.Bytes()[off:], "written by the peer")
	if got := string(p.Block(ids[1])[:19]); got != "written by the peer" {
		t.Errorf("block %d holds %q", ids[1], got)
	}
	p.Release(ids...)
}

func TestMapSharedErrors(t *testing.T) {
	unsealed, err := memfd.Create("kvcache-unsealed")
	if err != nil {
		t.Fatal(err)
	}
	defer unsealed.Close()
	if err := unsealed.Truncate(8192); err != nil {
		t.Fatal(err)
	}
	regular, err := os.CreateTemp(t.TempDir(), "regular")
	if err != nil {
		t.Fatal(err)
	}
	regular.Truncate(8192)
	defer regular.Close()
	a, err := ShmAllocator{}.Allocate(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	sealed := a.(*ShmArena).File()
	closed, _ := memfd.Create("kvcache-closed")
	closed.Close()

	tests := []struct {
		name string
		f    *os.File
		size int64
		want string
	}{
		{"nil file", nil, 4096, "nil file"},
		{"zero size", sealed, 0, "out of range"},
		{"larger than the file", sealed, 8192, "file is 4096 bytes, want at least 8192"},
		{"not sealed", unsealed, 4096, "not sealed against shrinking"},
		{"regular file", regular, 4096, "map shared memory"},
		{"closed file", closed, 4096, "kvcache: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := MapShared(tt.f, tt.size)
			if err == nil {
				m.Close()
				t.Fatal("MapShared succeeded")
			}
			if !strings.Contains(err.Error(), tt.want) || !strings.HasPrefix(err.Error(), "kvcache: ") {
				t.Errorf("error %q, want a kvcache: error containing %q", err, tt.want)
			}
		})
	}
}

// TestPeerReadOnly: a PeerReadOnly arena stays writable through its own
// mapping, a peer maps it read-only and sees the writes, and nobody can map
// it writable; MapSharedReadOnly refuses a file without a write seal.
func TestPeerReadOnly(t *testing.T) {
	a, err := ShmAllocator{Name: "kvxfer-test-ro", PeerReadOnly: true}.Allocate(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	sa := a.(*ShmArena)
	sa.Bytes()[100] = 42
	if _, err := MapShared(sa.File(), sa.Size()); err == nil {
		t.Error("MapShared (writable) of a PeerReadOnly file succeeded")
	}
	peer, err := MapSharedReadOnly(sa.File(), sa.Size())
	if err != nil {
		t.Fatalf("MapSharedReadOnly: %v", err)
	}
	defer peer.Close()
	if got := peer.Bytes()[100]; got != 42 {
		t.Errorf("peer reads %d, want 42", got)
	}
	sa.Bytes()[101] = 7
	if got := peer.Bytes()[101]; got != 7 {
		t.Errorf("peer reads %d after a later write, want 7", got)
	}

	plain, err := ShmAllocator{Name: "kvxfer-test-rw"}.Allocate(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := MapSharedReadOnly(plain.(*ShmArena).File(), 4096); err == nil || !strings.Contains(err.Error(), "sealed against writes") {
		t.Errorf("MapSharedReadOnly of a file without a write seal = %v, want an error about it", err)
	}
}
