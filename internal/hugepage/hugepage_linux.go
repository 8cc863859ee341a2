//go:build linux

package hugepage

import (
	"fmt"
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
