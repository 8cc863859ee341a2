//go:build mpi && cgo

package cli

// Builds with -tags mpi (and cgo, libopenmpi-dev) get the MPI backend and
// kvxfer serve-mpi's world.
import "github.com/kvxfer/kvxfer/transport/mpi"

func init() {
	mpiWorld = &mpiFuncs{init: mpi.Init, world: mpi.World, finalize: mpi.Finalize, abort: mpi.Abort}
}
