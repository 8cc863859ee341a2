//go:build ucx && cgo

package ucx

import (
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
// (a pool in reused Go heap memory) as huge pages, synchronously: measured
// here, 2.5 s for a GiB already touched, 0.1 ms for one not touched yet
// (the kernel refuses to collapse pages that are not there, which is
// fine: they come as huge pages when first touched). The contents are
// kept; nothing outside mem is touched. f is not used. The advice is best
// effort: a kernel without transparent huge pages leaves the memory as it
// was, which is logged once; RegisterMemory never fails.
func (t *Transport) RegisterMemory(mem []byte, f *os.File) error {
	if len(mem) == 0 {
		return nil
	}
	start, n, ok := hugeInterior(uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)))
	if !ok {
		return nil
	}
	if err := madvise(start, n, syscall.MADV_HUGEPAGE); err != nil {
		if t.adviceLogged.CompareAndSwap(false, true) {
			t.log.Info("ucx: registered memory stays in small pages, which cma copies at about half the speed",
				"advice", "MADV_HUGEPAGE", "bytes", n, "err", err)
		}
		return nil
	}
	if err := madvise(start, n, madvCollapse); err != nil {
		t.log.Debug("ucx: registered memory: pages already there stay small (first touches come huge)",
			"advice", "MADV_COLLAPSE", "bytes", n, "err", err)
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
