package kvcache

import (
	"bytes"
	"errors"
	"runtime"
	"testing"
)

func TestAllocators(t *testing.T) {
	allocators := []struct {
		name  string
		alloc Allocator
		unix  bool // needs a Unix system
		linux bool // needs Linux
	}{
		{"heap", HeapAllocator{}, false, false},
		{"mmap", MmapAllocator{}, true, false},
		{"mmap populate", MmapAllocator{Populate: true}, true, false},
		{"shm", ShmAllocator{Name: "kvcache-test"}, true, true},
		{"shm populate", ShmAllocator{Populate: true}, true, true},
	}
	for _, tt := range allocators {
		t.Run(tt.name, func(t *testing.T) {
			if tt.linux && runtime.GOOS != "linux" || tt.unix && !isUnix() {
				if _, err := tt.alloc.Allocate(4096); !errors.Is(err, errors.ErrUnsupported) {
					t.Errorf("Allocate on %s = %v, want ErrUnsupported", runtime.GOOS, err)
				}
				return
			}
			for _, size := range []int{0, -1} {
				if a, err := tt.alloc.Allocate(size); err == nil {
					a.Close()
					t.Errorf("Allocate(%d) succeeded", size)
				}
			}
			const size = 1<<20 + 123 // not a whole number of pages
			a, err := tt.alloc.Allocate(size)
			if err != nil {
				t.Fatal(err)
			}
			b := a.Bytes()
			if len(b) != size {
				t.Fatalf("len(Bytes()) = %d, want %d", len(b), size)
			}
			if !bytes.Equal(b, make([]byte, size)) {
				t.Error("new arena is not zeroed")
			}
			b[0], b[size-1] = 1, 2
			if b2 := a.Bytes(); &b2[0] != &b[0] || b2[size-1] != 2 {
				t.Error("Bytes returned different memory")
			}
			if err := a.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if a.Bytes() != nil {
				t.Error("Bytes after Close is not nil")
			}
			if err := a.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		})
	}
}

func isUnix() bool {
	switch runtime.GOOS {
	case "windows", "plan9", "js", "wasip1":
		return false
	}
	return true
}

// TestPoolOnEachAllocator runs a small workload on a pool over each
// allocator available here.
func TestPoolOnEachAllocator(t *testing.T) {
	allocs := map[string]Allocator{"heap": HeapAllocator{}, "default": nil}
	if isUnix() {
		allocs["mmap"] = MmapAllocator{}
	}
	if runtime.GOOS == "linux" {
		allocs["shm"] = ShmAllocator{}
	}
	for name, alloc := range allocs {
		t.Run(name, func(t *testing.T) {
			p, err := NewPool(testLayout, 8, alloc)
			if err != nil {
				t.Fatal(err)
			}
			var tb BlockTable
			if _, err := tb.Grow(p, 30); err != nil {
				t.Fatal(err)
			}
			for i, id := range tb.IDs() {
				b := p.Block(id)
				for j := range b {
					b[j] = byte(i)
				}
			}
			arena := p.Arena().Bytes()
			for i, id := range tb.IDs() {
				off := p.BlockOffset(id)
				if !bytes.Equal(arena[off:off+p.BlockBytes()], bytes.Repeat([]byte{byte(i)}, int(p.BlockBytes()))) {
					t.Errorf("block %d not at offset %d of the arena", id, off)
				}
			}
			if err := tb.Release(p); err != nil {
				t.Fatal(err)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
