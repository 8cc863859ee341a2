//go:build mpi && cgo

package mpi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

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
	// Finalize has stopped the progress goroutine: nothing of the
	// package's, nor of any test's, may be left, and no ignore is needed.
	if err := goleak.Find(); err != nil {
		fmt.Fprintf(os.Stderr, "goroutines left after Finalize: %v\n", err)
		code = 2
	}
	os.Exit(code)
}

// noLeaks checks, after the test's other cleanups, that it left the world
// as it found it (see settled) and no goroutine behind. The world's
// progress goroutine is process-wide by design (Init starts it, Finalize
// in TestMain stops it, and TestMain checks then that nothing is left at
// all): it is the one goroutine ignored, wherever in its loop it is (in
// C, waiting, or running a handler).
func noLeaks(t testing.TB) {
	t.Cleanup(func() {
		settled(t)
		goleak.VerifyNone(t, goleak.IgnoreAnyFunction(progressFunc))
	})
}

// settled fails t unless, within 5 s, the world holds no transport, no
// receipt and no Send, and has no request posted but its standing control
// receives: every receipt forgotten (one that ended early only once its
// sender has said how many frames it posted), every frame of one drained
// into scratch memory and that memory freed, every control send done.
func settled(t testing.TB) {
	t.Helper()
	w, err := current()
	if err != nil {
		t.Error(err)
		return
	}
	var trs, recvs, sends, active int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ch := make(chan int, 1)
		w.do(func() { ch <- w.active }) // the progress goroutine's
		select {
		case active = <-ch:
		case <-time.After(time.Until(deadline)):
			t.Errorf("the world's progress goroutine did not answer within 5 s of the test's end")
			return
		}
		w.mu.Lock()
		trs, recvs, sends = len(w.transports), len(w.recvs), len(w.sends)
		w.mu.Unlock()
		if trs == 0 && recvs == 0 && sends == 0 && active == standingCtl || time.Now().After(deadline) {
			break
		}
	}
	if trs != 0 || recvs != 0 || sends != 0 || active != standingCtl {
		t.Errorf("the world 5 s after the test: %d transports, %d receipts, %d sends, %d requests posted; want none but the %d standing control receives",
			trs, recvs, sends, active, standingCtl)
	}
}

// progressFunc is the world's progress goroutine, as goleak names it.
const progressFunc = "github.com/kvxfer/kvxfer/transport/mpi.(*world).run"

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
	noLeaks(t)
	transporttest.Run(t, func(t *testing.T) (a, b transport.Transport) {
		return open(t), open(t)
	})
}
