//go:build ucx && cgo

package ucx

import (
	"errors"
	"os"
	"syscall"
	"unsafe"

	"github.com/kvxfer/kvxfer/transport"
)

// madvCollapse is MADV_COLLAPSE (Linux 6.1): collapse a range into huge
// pages now, whatever the system's THP mode (syscall has no name for it).
const madvCollapse = 25

var _ transport.MemoryRegistrar = (*Transport)(nil)

// RegisterMemory asks the kernel to back mem with transparent huge pages:
// cma, which carries a shared-memory rendezvous, copies memory of 4 KiB
// pages (a Go heap pool) at about half the speed of huge pages. The
// aligned 2 MiB pages inside mem (hugeInterior; none for a region smaller
// than that) get MADV_HUGEPAGE, so that pages first touched later come as
// huge pages, then MADV_COLLAPSE, which rebuilds the pages already there
// (a pool in reused Go heap memory) as huge pages, synchronously. The
// contents are kept; nothing outside mem is touched. f is not used. The advice is best effort: a kernel without
// transparent huge pages, or one older than 6.1 (no MADV_COLLAPSE), leaves
// the memory as it was, which is logged once; RegisterMemory never fails.
func (t *Transport) RegisterMemory(mem []byte, f *os.File) error {
	if len(mem) == 0 {
		return nil
	}
	start, n, ok := hugeInterior(uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)))
	if !ok {
		return nil
	}
	if err := madvise(start, n, syscall.MADV_HUGEPAGE); err != nil {
		t.adviceFailed("MADV_HUGEPAGE", n, err)
		return nil
	}
	if err := madvise(start, n, madvCollapse); err != nil {
		t.adviceFailed("MADV_COLLAPSE", n, err)
	}
	return nil
}

// madvise advises the kernel about [addr, addr+n), which the caller has
// checked lies inside a live Go slice.
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

// adviceFailed logs, once per Transport, that memory stays in small pages.
func (t *Transport) adviceFailed(advice string, n uintptr, err error) {
	if !t.adviceLogged.CompareAndSwap(false, true) {
		return
	}
	why := "the memory keeps the pages it has"
	if errors.Is(err, syscall.EINVAL) {
		why = "this kernel lacks the advice"
	}
	t.log.Info("ucx: huge-page advice for registered memory failed; cma copies 4 KiB pages at about half the speed",
		"advice", advice, "bytes", n, "err", err, "why", why)
}
