//go:build !unix

package kvcache

import (
	"errors"
	"fmt"
	"runtime"
)

// Allocate returns an error: anonymous mappings need a Unix system.
func (MmapAllocator) Allocate(size int) (Arena, error) {
	return nil, fmt.Errorf("kvcache: mmap arenas are not available on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

func munmap([]byte) error { return nil }
