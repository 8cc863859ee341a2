//go:build unix

package kvcache

import (
	"fmt"
	"sync"
	"syscall"
)

// Allocate maps size bytes of private anonymous memory.
func (a MmapAllocator) Allocate(size int) (Arena, error) {
	if err := checkArenaSize(int64(size)); err != nil {
		return nil, err
	}
	flags := syscall.MAP_PRIVATE | syscall.MAP_ANON
	if a.Populate {
		flags |= mapPopulate
	}
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, flags)
	if err != nil {
		return nil, fmt.Errorf("kvcache: mmap %d bytes: %w", size, err)
	}
	return &mmapArena{b: b}, nil
}

type mmapArena struct {
	mu sync.Mutex
	b  []byte // exactly the slice syscall.Mmap returned; nil once closed
}

func (a *mmapArena) Bytes() []byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.b
}

func (a *mmapArena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.b == nil {
		return nil
	}
	err := munmap(a.b)
	a.b = nil
	return err
}

// munmap unmaps b, which must be a slice returned by syscall.Mmap.
func munmap(b []byte) error {
	if err := syscall.Munmap(b); err != nil {
		return fmt.Errorf("kvcache: munmap: %w", err)
	}
	return nil
}
