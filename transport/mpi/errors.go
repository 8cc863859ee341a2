package mpi

import (
	"errors"
	"fmt"
)

// Errors of the package.
var (
	// ErrNotInitialised: Open before Init (kvxfer serve-mpi calls Init on
	// every rank of the world; a process outside mpirun has no world).
	ErrNotInitialised = errors.New("mpi: the MPI world is not initialised (run the workers under mpirun through kvxfer serve-mpi)")
	// ErrThreadLevel: the MPI library cannot provide MPI_THREAD_MULTIPLE.
	ErrThreadLevel = errors.New("mpi: the MPI library does not provide MPI_THREAD_MULTIPLE")
	// ErrFinalized: Init after Finalize (MPI cannot start again).
	ErrFinalized = errors.New("mpi: MPI has been finalized in this process")
	// ErrReceiptGone: the receipt a Send names is no longer armed: it was
	// cancelled, has completed, or another Send claimed it. Its data was
	// not delivered.
	ErrReceiptGone = errors.New("mpi: the receipt is no longer armed (cancelled, done, or claimed by another send)")
)

// Error is a failed MPI call: the function, its error code and the
// library's text for it.
type Error struct {
	Op   string
	Code int
	Msg  string
}

func (e *Error) Error() string { return fmt.Sprintf("mpi: %s: error %d: %s", e.Op, e.Code, e.Msg) }
