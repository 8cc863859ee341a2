package memfd

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func fd(t *testing.T, f *os.File) int {
	t.Helper()
	var n int
	if err := control(f, func(fd int) error { n = fd; return nil }); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestNew: New's file is sized, sealed (against writes too with
// PeerReadOnly), on tmpfs, and its own mapping stays writable.
func TestNew(t *testing.T) {
	for _, ro := range []bool{false, true} {
		m, err := New("memfd-test", 8192, Options{Populate: true, PeerReadOnly: ro})
		if err != nil {
			t.Fatal(err)
		}
		m.Bytes()[8191] = 1 // writable
		seals, err := Seals(m.File())
		if err != nil {
			t.Fatal(err)
		}
		want := SealShrink | SealGrow | SealSeal
		if ro {
			want |= SealFutureWrite
		}
		if seals != want {
			t.Errorf("PeerReadOnly %v: seals %#x, want %#x", ro, seals, want)
		}
		if st, err := m.File().Stat(); err != nil || st.Size() != 8192 || m.Size() != 8192 {
			t.Errorf("file of %v bytes (%v), Size %d", st.Size(), err, m.Size())
		}
		if !IsShmem(fd(t, m.File())) {
			t.Error("a memory file is not on tmpfs")
		}
		if err := AddSeals(m.File(), SealWrite); err == nil {
			t.Error("a seal added after SealSeal")
		}
		f := m.File()
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if m.Bytes() != nil || m.File() != nil || m.Close() != nil {
			t.Error("Close did not leave an empty, closed Mapping")
		}
		if _, err := f.Stat(); err == nil {
			t.Error("Close left the file open")
		}
	}
	if _, err := New("memfd-test", 0, Options{}); err == nil {
		t.Error("New of 0 bytes succeeded")
	}
	if _, err := New("bad\x00name", 4096, Options{}); err == nil {
		t.Error("New with a NUL in the name succeeded")
	}
}

// TestMapPeer: a peer's mapping sees the creator's writes; Map and
// MapReadOnly refuse every file that could make their mapping fault or
// change under a read-only mapping, and say why.
func TestMapPeer(t *testing.T) {
	ro, err := New("memfd-test-ro", 8192, Options{PeerReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	rw, err := New("memfd-test-rw", 4096, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()

	peer, err := MapReadOnly(ro.File(), ro.Size())
	if err != nil {
		t.Fatal(err)
	}
	ro.Bytes()[100] = 42
	if peer.Bytes()[100] != 42 || peer.File() != nil {
		t.Errorf("read-only peer mapping reads %d, File %v", peer.Bytes()[100], peer.File())
	}
	peer.Close()
	peer, err = Map(rw.File(), 4096)
	if err != nil {
		t.Fatal(err)
	}
	peer.Bytes()[7] = 9
	if rw.Bytes()[7] != 9 {
		t.Error("a write through the peer's mapping is not seen by the creator")
	}
	peer.Close()

	unsealed, err := Create("memfd-test-unsealed")
	if err != nil {
		t.Fatal(err)
	}
	defer unsealed.Close()
	unsealed.Truncate(8192)
	shrinkOnly, _ := Create("memfd-test-shrink")
	defer shrinkOnly.Close()
	shrinkOnly.Truncate(8192)
	if err := AddSeals(shrinkOnly, SealShrink); err != nil {
		t.Fatal(err)
	}
	regular, err := os.CreateTemp(t.TempDir(), "regular")
	if err != nil {
		t.Fatal(err)
	}
	defer regular.Close()
	regular.Truncate(8192)
	closed, _ := Create("memfd-test-closed")
	closed.Close()

	for _, tt := range []struct {
		name     string
		f        *os.File
		size     int64
		readOnly bool
		want     string
	}{
		{"nil file", nil, 4096, false, "nil file"},
		{"zero size", rw.File(), 0, false, "out of range"},
		{"larger than the file", rw.File(), 8192, false, "file is 4096 bytes, want at least 8192"},
		{"not sealed", unsealed, 4096, false, "not sealed against shrinking"},
		{"not a memfd", regular, 4096, false, "sealed"}, // on tmpfs: "not sealed against shrinking"
		{"closed file", closed, 4096, false, "memfd: "},
		{"writable map of a read-only file", ro.File(), 4096, false, "mmap"},
		{"read-only map without a write seal", shrinkOnly, 4096, true, "not sealed against writes"},
		{"read-only map of a writable file", rw.File(), 4096, true, "not sealed against writes"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			mapf := Map
			if tt.readOnly {
				mapf = MapReadOnly
			}
			m, err := mapf(tt.f, tt.size)
			if err == nil {
				m.Close()
				t.Fatal("mapped")
			}
			if !strings.Contains(err.Error(), tt.want) || !strings.HasPrefix(err.Error(), "memfd: ") {
				t.Errorf("error %q, want a memfd: error containing %q", err, tt.want)
			}
		})
	}
}

func TestIsShmem(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if IsShmem(fd(t, r)) {
		t.Error("a pipe is shared memory")
	}
	if IsShmem(-1) {
		t.Error("a bad descriptor is shared memory")
	}
	var fs unix.Statfs_t
	if err := unix.Statfs("/proc", &fs); err == nil && fs.Type == unix.TMPFS_MAGIC {
		t.Skip("/proc on tmpfs")
	}
	proc, err := os.Open("/proc/self/stat")
	if err != nil {
		t.Skip(err)
	}
	defer proc.Close()
	if IsShmem(fd(t, proc)) {
		t.Error("a /proc file is shared memory")
	}
}
