//go:build !linux

package hugepage

import (
	"errors"
	"fmt"
	"runtime"
)

// Advise reports errors.ErrUnsupported: transparent huge pages are Linux's.
func Advise(mem []byte) (Report, error) {
	if len(mem) == 0 {
		return Report{}, nil
	}
	return Report{}, fmt.Errorf("hugepage: no transparent huge pages on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}

// Backed reports errors.ErrUnsupported: transparent huge pages are Linux's.
func Backed(mem []byte) (int64, error) {
	if len(mem) == 0 {
		return 0, nil
	}
	return 0, fmt.Errorf("hugepage: no transparent huge pages on %s: %w", runtime.GOOS, errors.ErrUnsupported)
}
