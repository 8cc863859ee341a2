//go:build ucx && cgo

package ucx

import (
	"bytes"
	"fmt"
	"os"
	"syscall"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/hugepage"
)

// TestRegisterMemoryHugePages: RegisterMemory backs the aligned interior of
// a region with huge pages (AnonHugePages in /proc/self/smaps), and only
// it: memory already touched in 4 KiB pages at once, keeping its contents,
// and memory not touched yet at its first touch.
func TestRegisterMemoryHugePages(t *testing.T) {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil || bytes.Contains(b, []byte("[never]")) {
		t.Skipf("transparent huge pages are off here (%q, %v)", b, err)
	}
	tr := open(t)
	defer tr.Close()
	for _, touched := range []bool{true, false} {
		t.Run(fmt.Sprintf("touched=%v", touched), func(t *testing.T) {
			const n = 16 << 20
			m, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Munmap(m)
			if err := syscall.Madvise(m, syscall.MADV_NOHUGEPAGE); err != nil {
				t.Fatal(err)
			}
			if touched {
				fillPattern(7, m)
			}
			if got := backed(t, m); got != 0 {
				t.Fatalf("%d bytes of huge pages before RegisterMemory", got)
			}
			// An unaligned region, as a Go heap pool is: 4 KiB in.
			region := m[4096 : n-4096]
			if err := tr.RegisterMemory(region, nil); err != nil {
				t.Fatal(err)
			}
			if !touched {
				fillPattern(7, m) // first touch: huge pages where advised
			}
			start, length, _ := hugepage.Interior(uintptr(unsafe.Pointer(&region[0])), uintptr(len(region)))
			if got := backed(t, m); got != int64(length) {
				t.Fatalf("%d bytes of huge pages after RegisterMemory, want %d (the aligned interior from %#x)", got, length, start)
			}
			if i := firstDiff(m, 7); i >= 0 {
				t.Fatalf("contents changed at byte %d", i)
			}
		})
	}
}

// backed is hugepage.Backed, skipping the test when smaps cannot be read.
func backed(t *testing.T, m []byte) int64 {
	t.Helper()
	n, err := hugepage.Backed(m)
	if err != nil {
		t.Skipf("cannot read the backing: %v", err)
	}
	return n
}
