//go:build mpi && cgo && linux

package mpi

import (
	"fmt"
	"syscall"
	"unsafe"
)

// madvPopulateWrite is MADV_POPULATE_WRITE (Linux 5.14), which syscall
// does not name.
const madvPopulateWrite = 23

// populate faults every page of mem in, writable, now (MADV_POPULATE_WRITE):
// the kernel does what a first write to each page would, without writing,
// so the contents are kept. A kernel before 5.14 refuses it (EINVAL).
func populate(mem []byte) error {
	if len(mem) == 0 {
		return nil
	}
	for try := 0; ; try++ {
		_, _, e := syscall.Syscall(syscall.SYS_MADVISE, uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)), madvPopulateWrite)
		switch {
		case e == 0:
			return nil
		case e == syscall.EINTR && try < 3:
			continue
		}
		return fmt.Errorf("mpi: MADV_POPULATE_WRITE on %d bytes at %p: %w", len(mem), unsafe.SliceData(mem), e)
	}
}
