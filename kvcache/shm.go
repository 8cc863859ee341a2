package kvcache

import (
	"errors"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/internal/memfd"
)

// Allocate creates a sealed memory file of size bytes and maps it shared.
// The returned Arena is a *ShmArena.
func (a ShmAllocator) Allocate(size int) (Arena, error) {
	if err := checkArenaSize(int64(size)); err != nil {
		return nil, err
	}
	name := a.Name
	if name == "" {
		name = "kvxfer"
	}
	m, err := memfd.New(name, size, memfd.Options{Populate: a.Populate, PeerReadOnly: a.PeerReadOnly})
	if err != nil {
		return nil, fmt.Errorf("kvcache: allocate shared memory: %w", err)
	}
	return &ShmArena{m: m}, nil
}

// MapShared maps the first size bytes of a memory file received from
// another process (the File of a peer's *ShmArena, typically received over
// a Unix socket with SCM_RIGHTS), read-write and shared, so that writes
// through either mapping are visible through the other. The returned Arena
// is a *ShmArena whose File is nil.
//
// MapShared does not take ownership of f: the caller closes it, and may do
// so as soon as MapShared returns, because the mapping does not need the
// descriptor. Close the returned arena to unmap.
//
// The file must be at least size bytes long and sealed against shrinking
// (as ShmAllocator's files are): memory of a file that a peer could shrink
// would fault with SIGBUS on access and kill this process.
func MapShared(f *os.File, size int64) (Arena, error) {
	return mapShared(f, size, memfd.Map)
}

// MapSharedReadOnly is MapShared for reading only: the mapping cannot be
// written, and it works on files sealed against writes (ShmAllocator with
// PeerReadOnly), which MapShared cannot map. The file must be sealed
// against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE) and be the kernel's
// ordinary shared memory (tmpfs; not hugetlbfs, whose pages a peer could
// release under the mapping): then no peer can make a read of the mapping
// fault.
func MapSharedReadOnly(f *os.File, size int64) (Arena, error) {
	return mapShared(f, size, memfd.MapReadOnly)
}

func mapShared(f *os.File, size int64, mapf func(*os.File, int64) (*memfd.Mapping, error)) (Arena, error) {
	if f == nil {
		return nil, errors.New("kvcache: map shared memory: nil file")
	}
	if err := checkArenaSize(size); err != nil {
		return nil, err
	}
	m, err := mapf(f, size)
	if err != nil {
		return nil, fmt.Errorf("kvcache: map shared memory: %w", err)
	}
	return &ShmArena{m: m}, nil
}
