//go:build mpi && cgo && !linux

package mpi

import (
	"errors"
	"fmt"
)

// populate is not done outside Linux: pages are faulted in by their first
// copy, as they would be without registration.
func populate(mem []byte) error {
	return fmt.Errorf("mpi: populate %d bytes: %w", len(mem), errors.ErrUnsupported)
}
