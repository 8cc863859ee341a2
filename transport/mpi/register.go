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
	hugepage.AdviseLogged(mem, t.log, "mpi", ", which cma copies at about half the speed", &t.adviceLogged)
	return nil
}
