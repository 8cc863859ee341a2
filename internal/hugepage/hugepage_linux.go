//go:build linux

package hugepage

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"unsafe"
)

// madvCollapse is MADV_COLLAPSE (Linux 6.1): collapse a range into huge
// pages now, whatever the system's THP mode (syscall has no name for it).
const madvCollapse = 25

// Advise gives the huge-page interior of mem (Interior) MADV_HUGEPAGE, then
// MADV_COLLAPSE; see the package documentation. It fails, having changed
// nothing, when the kernel refuses MADV_HUGEPAGE; a refused MADV_COLLAPSE
// is in the Report, not an error. mem must stay valid while Advise runs;
// its contents are kept, and nothing outside it is touched.
func Advise(mem []byte) (Report, error) {
	if len(mem) == 0 {
		return Report{}, nil
	}
	start, n, ok := Interior(uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)))
	if !ok {
		return Report{}, nil
	}
	if err := madvise(start, n, syscall.MADV_HUGEPAGE); err != nil {
		return Report{}, fmt.Errorf("hugepage: MADV_HUGEPAGE on %d bytes at %#x: %w", n, start, err)
	}
	r := Report{Bytes: n}
	if err := madvise(start, n, madvCollapse); err != nil {
		r.Collapse = fmt.Errorf("hugepage: MADV_COLLAPSE on %d bytes at %#x: %w", n, start, err)
	}
	return r, nil
}

// madvise advises the kernel about [addr, addr+n), which Advise has
// checked lies inside a live slice.
func madvise(addr, n uintptr, advice int) error {
	for try := 0; ; try++ {
		_, _, e := syscall.Syscall(syscall.SYS_MADVISE, addr, n, uintptr(advice))
		if e == 0 {
			return nil
		}
		// EAGAIN: MADV_COLLAPSE met a busy page.
		if (e == syscall.EINTR || e == syscall.EAGAIN) && try < 3 {
			continue
		}
		return e
	}
}

// Backed returns how many bytes of the mappings that lie wholly within mem
// the kernel backs with transparent huge pages (AnonHugePages in
// /proc/self/smaps), for tests and diagnostics. A mapping that only
// overlaps mem does not count.
func Backed(mem []byte) (int64, error) {
	if len(mem) == 0 {
		return 0, nil
	}
	lo := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
	hi := lo + uint64(len(mem))
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return 0, fmt.Errorf("hugepage: %w", err)
	}
	defer f.Close()
	var total int64
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if a, b, ok := strings.Cut(fields[0], "-"); ok && !strings.HasSuffix(fields[0], ":") {
			start, err1 := strconv.ParseUint(a, 16, 64)
			end, err2 := strconv.ParseUint(b, 16, 64)
			if err1 == nil && err2 == nil {
				in = start >= lo && end <= hi
				continue
			}
		}
		if in && fields[0] == "AnonHugePages:" && len(fields) >= 2 {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("hugepage: smaps: %q: %w", sc.Text(), err)
			}
			total += kb << 10
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("hugepage: smaps: %w", err)
	}
	return total, nil
}
