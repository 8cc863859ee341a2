//go:build linux

package hugepage

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"strconv"
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

// anonHuge returns the AnonHugePages of the mapping of /proc/self/smaps
// that holds addr, in bytes.
func anonHuge(t *testing.T, addr uintptr) uintptr {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no /proc/self/smaps: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) > 0 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			lo, hi, _ := strings.Cut(fields[0], "-")
			a, err1 := strconv.ParseUint(lo, 16, 64)
			b, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uint64(addr) >= a && uint64(addr) < b
			continue
		}
		if in && len(fields) >= 2 && fields[0] == "AnonHugePages:" {
			kb, err := strconv.ParseUint(fields[1], 10, 64)
			if err != nil {
				t.Fatalf("smaps: %q: %v", line, err)
			}
			return uintptr(kb) << 10
		}
	}
	t.Fatalf("smaps: no mapping holds %#x", addr)
	return 0
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
	if got := anonHuge(t, start); got < length {
		t.Fatalf("after MADV_COLLAPSE the mapping has %d bytes of huge pages, want at least the interior's %d", got, length)
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
