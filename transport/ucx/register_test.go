//go:build ucx && cgo

package ucx

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
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
			if got := anonHuge(t, m); got != 0 {
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
			if got := anonHuge(t, m); got != int64(length) {
				t.Fatalf("%d bytes of huge pages after RegisterMemory, want %d (the aligned interior from %#x)", got, length, start)
			}
			if i := firstDiff(m, 7); i >= 0 {
				t.Fatalf("contents changed at byte %d", i)
			}
		})
	}
}

// anonHuge returns AnonHugePages of the mappings that lie within m.
func anonHuge(t *testing.T, m []byte) int64 {
	t.Helper()
	lo := uint64(uintptr(unsafe.Pointer(&m[0])))
	hi := lo + uint64(len(m))
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no smaps: %v", err)
	}
	defer f.Close()
	var total int64
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if a, b, ok := strings.Cut(strings.Fields(line + " ")[0], "-"); ok && !strings.HasSuffix(line, ":") {
			start, err1 := strconv.ParseUint(a, 16, 64)
			end, err2 := strconv.ParseUint(b, 16, 64)
			if err1 == nil && err2 == nil {
				in = start >= lo && end <= hi
				continue
			}
		}
		if in && strings.HasPrefix(line, "AnonHugePages:") {
			kb, err := strconv.ParseInt(strings.Fields(line)[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			total += kb << 10
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return total
}
