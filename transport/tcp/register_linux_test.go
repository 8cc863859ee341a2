package tcp

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/hugepage"
	"github.com/kvxfer/kvxfer/transport"
	"golang.org/x/sys/unix"
)

// TestRegisterMemory: tcp is a transport.MemoryRegistrar that advises a
// pool to huge pages, keeping its contents (where the kernel has
// transparent huge pages); empty memory and a closed transport are
// refused.
func TestRegisterMemory(t *testing.T) {
	a := open(t, transport.Options{})
	var _ transport.MemoryRegistrar = a
	if err := a.RegisterMemory(nil, nil); err == nil {
		t.Error("RegisterMemory(empty) = nil")
	}
	if mode, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err == nil && !strings.Contains(string(mode), "[never]") {
		const n = 2 * hugepage.Size
		raw, err := unix.Mmap(-1, 0, n+hugepage.Size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(raw)
		off := int(-uintptr(unsafe.Pointer(&raw[0])) & (hugepage.Size - 1))
		mem := raw[off : off+n : off+n]
		if err := unix.Madvise(mem, unix.MADV_NOHUGEPAGE); err != nil {
			t.Fatal(err)
		}
		want := seq(n, 3)
		copy(mem, want)
		if got, err := hugepage.Backed(mem); err != nil || got != 0 {
			t.Fatalf("before RegisterMemory: %d bytes in huge pages, %v; want 0", got, err)
		}
		if err := a.RegisterMemory(mem, nil); err != nil {
			t.Fatal(err)
		}
		if got, err := hugepage.Backed(mem); err != nil || got == 0 {
			t.Errorf("after RegisterMemory: %d bytes of %d in huge pages, %v", got, n, err)
		}
		if !bytes.Equal(mem, want) {
			t.Error("RegisterMemory changed the memory's contents")
		}
	}
	a.Close()
	var ce *transport.ClosedError
	if err := a.RegisterMemory(make([]byte, 1), nil); !errors.As(err, &ce) {
		t.Errorf("RegisterMemory after Close = %v, want a *transport.ClosedError", err)
	}
}
