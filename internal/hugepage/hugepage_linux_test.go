//go:build linux

package hugepage

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"unsafe"
)

// thpEnabled reports the kernel's transparent huge page mode ("always",
// "madvise", "never"), or "" when the kernel has none.
func thpEnabled() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.IndexByte(s, '['); i >= 0 {
		if j := strings.IndexByte(s[i:], ']'); j > 0 {
			return s[i+1 : i+j]
		}
	}
	return ""
}

// TestAdvise advises a written anonymous mapping: the contents are kept,
// the interior is reported, and where MADV_COLLAPSE succeeded the kernel
// backs the whole interior with huge pages.
func TestAdvise(t *testing.T) {
	const n = 6*Size + 12345
	mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	defer syscall.Munmap(mem)
	// Its own flags, so that the kernel does not merge it with a
	// neighbouring mapping (Backed counts mappings wholly inside it).
	if err := syscall.Madvise(mem, syscall.MADV_NOHUGEPAGE); err != nil {
		t.Fatal(err)
	}
	// Advise a slice that starts off a page boundary, so that the
	// interior is not the whole mapping.
	region := mem[4096:]
	for i := range region {
		region[i] = byte(i*7 + i>>13)
	}
	want := bytes.Clone(region)
	rep, err := Advise(region)
	if thpEnabled() == "" || thpEnabled() == "never" {
		if err == nil {
			t.Logf("THP mode %q, yet MADV_HUGEPAGE was accepted", thpEnabled())
		}
		t.Skipf("no transparent huge pages here (mode %q): %v", thpEnabled(), err)
	}
	if err != nil {
		t.Fatalf("Advise: %v", err)
	}
	start, length, _ := Interior(uintptr(unsafe.Pointer(&region[0])), uintptr(len(region)))
	if rep.Bytes != length || length < 4*Size {
		t.Fatalf("Advise reported %d bytes, want the interior's %d", rep.Bytes, length)
	}
	if !bytes.Equal(region, want) {
		t.Fatal("Advise changed the contents")
	}
	if rep.Collapse != nil {
		if !errors.Is(rep.Collapse, syscall.EINVAL) {
			t.Logf("MADV_COLLAPSE: %v", rep.Collapse)
		}
		t.Skipf("the kernel did not collapse (%v): the pages present stay small", rep.Collapse)
	}
	got, err := Backed(mem)
	if err != nil {
		t.Skipf("cannot read the backing: %v", err)
	}
	if got != int64(length) {
		t.Fatalf("after MADV_COLLAPSE the mapping has %d bytes of huge pages, want the interior's %d (from %#x)", got, length, start)
	}
}

func TestAdviseSmallAndEmpty(t *testing.T) {
	for _, n := range []int{0, 1, Size - 1} {
		mem := make([]byte, n)
		for i := range mem {
			mem[i] = byte(i)
		}
		rep, err := Advise(mem)
		if err != nil || rep != (Report{}) {
			t.Fatalf("Advise(%d bytes) = %+v, %v; want nothing advised", n, rep, err)
		}
		for i := range mem {
			if mem[i] != byte(i) {
				t.Fatalf("Advise(%d bytes) changed byte %d", n, i)
			}
		}
	}
}
