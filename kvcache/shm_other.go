//go:build !linux

package kvcache

import (
	"errors"
	"fmt"
	"os"
	"runtime"
)

const mapPopulate = 0

// Allocate returns an error: shared-memory arenas need Linux's memfd_create.
func (ShmAllocator) Allocate(size int) (Arena, error) {
	return nil, errShmUnsupported()
}

// MapShared returns an error: shared-memory arenas need Linux.
func MapShared(f *os.File, size int64) (Arena, error) {
	return nil, errShmUnsupported()
}

func errShmUnsupported() error {
	return fmt.Errorf("kvcache: shared-memory arenas are not available on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

// MapSharedReadOnly returns an error: shared-memory arenas need Linux.
func MapSharedReadOnly(f *os.File, size int64) (Arena, error) {
	return nil, errShmUnsupported()
}
