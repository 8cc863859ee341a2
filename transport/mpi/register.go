//go:build mpi && cgo

package mpi

import (
	"os"

	"github.com/kvxfer/kvxfer/internal/hugepage"
	"github.com/kvxfer/kvxfer/transport"
)

var _ transport.MemoryRegistrar = (*Transport)(nil)

// RegisterMemory asks the kernel to back mem with transparent huge pages
// (hugepage.Advise): OpenMPI's vader component moves a large message with
// one cma copy (process_vm_readv) by the receiving rank, and the kernel
// copies memory of 4 KiB pages (a Go heap pool) at about half the speed of
// huge pages. Any memory may still be sent or received: registering it
// only makes it faster. The contents are kept, nothing outside mem is
// touched, f is not used. The advice is best effort: a kernel without
// transparent huge pages leaves the memory as it was, which is logged once;
// RegisterMemory never fails.
func (t *Transport) RegisterMemory(mem []byte, _ *os.File) error {
	rep, err := hugepage.Advise(mem)
	switch {
	case err != nil:
		if t.adviceLogged.CompareAndSwap(false, true) {
			t.log.Info("mpi: registered memory stays in small pages, which cma copies at about half the speed", "err", err)
		}
	case rep.Collapse != nil:
		t.log.Debug("mpi: registered memory: pages already there stay small (first touches come huge)", "err", rep.Collapse)
	case rep.Bytes > 0:
		t.log.Debug("mpi: registered memory advised to huge pages", "bytes", rep.Bytes)
	}
	return nil
}
