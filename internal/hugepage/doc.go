// Package hugepage asks the kernel to back a region of memory with
// transparent huge pages: the advice the data planes give the pools they
// move data between (transport/mpi's RegisterMemory).
//
// Shared-memory transports on one host copy between processes with a
// single copy through the kernel (cma: process_vm_readv), and the kernel
// copies memory in 4 KiB pages at about half the speed of 2 MiB pages
// (measured here: OpenMPI's vader between two ranks, 512 MiB in 4 MiB
// messages, 4.7-6.1 GB/s from 4 KiB pages, 12.4-13.1 GB/s from huge
// pages). Go's heap, where the pools live, is in 4 KiB pages unless the
// kernel's THP mode is "always", and it is "madvise" on most
// distributions, this container's included.
//
// Interior (pure) finds the whole, aligned huge pages inside a region, so
// that advice never reaches memory outside it; Advise gives the region's
// interior MADV_HUGEPAGE, so that pages first touched later come huge,
// then MADV_COLLAPSE (Linux 6.1), which rebuilds the pages already there
// as huge pages, synchronously and keeping their contents (about 2.5 s
// for a GiB already touched, 0.1 ms for one not touched yet). It is best
// effort: a kernel without transparent huge pages refuses MADV_HUGEPAGE,
// which Advise returns as an error for the caller to log; the memory stays
// as it was. On systems other than Linux Advise reports
// errors.ErrUnsupported.
package hugepage
