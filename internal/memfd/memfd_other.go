//go:build !linux

package memfd

import (
	"errors"
	"fmt"
	"os"
	"runtime"
)

// New returns an error: memory files need Linux.
func New(name string, size int, o Options) (*Mapping, error) { return nil, errUnsupported() }

// Map returns an error: memory files need Linux.
func Map(f *os.File, size int64) (*Mapping, error) { return nil, errUnsupported() }

// MapReadOnly returns an error: memory files need Linux.
func MapReadOnly(f *os.File, size int64) (*Mapping, error) { return nil, errUnsupported() }

func errUnsupported() error {
	return fmt.Errorf("memfd: memory files are not available on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

// unmap is never called: no Mapping is ever made here.
func unmap([]byte) error { return nil }
