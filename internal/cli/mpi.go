//go:build mpi && cgo

package cli

// Builds with -tags mpi (and cgo, libopenmpi-dev) get the MPI backend.
import _ "github.com/kvxfer/kvxfer/transport/mpi"
