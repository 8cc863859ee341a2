//go:build !mpi || !cgo

package transport

import "fmt"

// Without the build tag mpi (or without cgo, which the OpenMPI binding
// needs) the backend is listed with the reason; with both, package
// transport/mpi registers the real one when the binary imports it.
func init() {
	RegisterUnavailable("mpi", fmt.Errorf("%w: build with -tags mpi (needs libopenmpi-dev)", ErrNotBuilt))
}
