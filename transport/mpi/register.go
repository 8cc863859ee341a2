//go:build mpi && cgo

package mpi

import (
	"os"

	"github.com/kvxfer/kvxfer/internal/hugepage"
	"github.com/kvxfer/kvxfer/transport"
)

var _ transport.MemoryRegistrar = (*Transport)(nil)

// RegisterMemory prepares mem for the copies of OpenMPI's vader component,
// which moves a large message with one cma copy (process_vm_readv) by the
// receiving rank, as a verbs registration (ibv_reg_mr) prepares memory for
// a NIC:
//
//   - it asks the kernel to back mem with transparent huge pages
//     (hugepage.Advise): the kernel copies memory of 4 KiB pages (a Go
//     heap pool) at about half the speed of huge pages;
//   - then it faults every page of mem in (MADV_POPULATE_WRITE), so that
//     the first transfer into a pool does not pay for its first touch
//     inside the peer's copy (on this VM a first 512 MiB request took
//     1.3-2.0 s, against about 0.06 s once the pool was touched; the
//     populate takes that time here instead; docs/perf-notes.md, MPI).
//
// Any memory may still be sent or received: registering it only makes it
// faster. The contents are kept, nothing outside mem is touched, f is not
// used; the pool's pages are resident from then on, as a KV cache's are
// once used. Both steps are best effort: a kernel without transparent huge
// pages leaves the memory as it was, which is logged once, and one that
// cannot populate (before Linux 5.14) leaves the first touch to the first
// copy, which is logged at Debug; RegisterMemory never fails.
func (t *Transport) RegisterMemory(mem []byte, _ *os.File) error {
	hugepage.AdviseLogged(mem, t.log, "mpi", ", which cma copies at about half the speed", &t.adviceLogged)
	if err := populate(mem); err != nil {
		t.log.Debug("mpi: registered memory left to be faulted in by its first copy", "bytes", len(mem), "err", err)
	}
	return nil
}
