//go:build mpi && cgo

package mpi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

// TestMain initialises the MPI world: a singleton (rank 0 of 1) under plain
// go test, or one rank of mpirun -np N (make mpi runs N = 2); the cross-rank
// tests need two ranks and skip without them.
func TestMain(m *testing.M) {
	if err := Init(nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	// Every cross-rank test of rank 0 waited for rank 1 to end it, so no
	// rank creates a link directory any more: the root they shared goes
	// (when empty: a failed test leaves its files to read).
	if w, err := current(); err == nil && w.rank == 0 {
		os.Remove(linkRoot(w))
	}
	if err := Finalize(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 2
		}
	}
	// After Finalize: no world to open on, and none to start again.
	if _, err := Open(context.Background(), transport.Options{}); !errors.Is(err, ErrNotInitialised) {
		fmt.Fprintf(os.Stderr, "Open after Finalize = %v, want ErrNotInitialised\n", err)
		code = 2
	}
	if err := Init(nil); !errors.Is(err, ErrFinalized) {
		fmt.Fprintf(os.Stderr, "Init after Finalize = %v, want ErrFinalized\n", err)
		code = 2
	}
	if err := Finalize(); err != nil {
		fmt.Fprintf(os.Stderr, "Finalize again = %v, want nil (idempotent)\n", err)
		code = 2
	}
	os.Exit(code)
}

func open(t *testing.T) transport.Transport {
	t.Helper()
	tr, err := transport.Open(context.Background(), "mpi", transport.Options{})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// TestConformance runs the suite between two transports of this rank (MPI
// sends to its own rank through the self component): every rank of the
// world runs it.
func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (a, b transport.Transport) {
		return open(t), open(t)
	})
}
