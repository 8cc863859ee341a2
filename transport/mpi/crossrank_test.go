//go:build mpi && cgo

package mpi

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

// link is how the ranks of a cross-rank test tell each other descriptors
// and results: files in a directory named by the world's epoch (the ranks
// of make mpi share a host).
type link struct {
	dir  string
	rank int
}

// crossRanks returns the link between ranks 0 and 1, skipping the test on
// a world of one rank and on ranks above 1.
func crossRanks(t testing.TB) link {
	t.Helper()
	w, err := current()
	if err != nil {
		t.Fatal(err)
	}
	if w.size < 2 {
		t.Skip("needs two MPI ranks: run under mpirun -np 2 (make mpi)")
	}
	if w.rank > 1 {
		t.Skip("ranks 0 and 1 run it")
	}
	noLeaks(t) // first: its cleanup runs after the link's and the transports'
	// The directory is the test's name and its place in the run: a test
	// run again (-test.count) gets a new one, so that rank 1's next run
	// cannot write into the directory rank 0 is about to remove, nor read
	// the files of the run before. Both ranks run the same tests in the
	// same order, so they count alike.
	linkRuns++
	dir := filepath.Join(linkRoot(w), fmt.Sprintf("%s.%d", t.Name(), linkRuns))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	l := link{dir: dir, rank: w.rank}
	// Rank 1 says it has read all it will read; rank 0 then removes the
	// directory of the test. The directory above it stays until TestMain:
	// removed here, it could vanish between rank 1's creating it for its
	// next test and creating that test's directory in it.
	t.Cleanup(func() {
		if l.rank == 1 {
			l.put(t, "end", nil)
			return
		}
		l.get(t, "end")
		os.RemoveAll(dir)
	})
	return l
}

// linkRuns counts the cross-rank tests this rank has started.
var linkRuns int

// linkRoot is the directory the cross-rank tests of world w keep their
// links in.
func linkRoot(w *world) string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvxfer-mpitest-%x", w.epoch))
}

func (l link) put(t testing.TB, name string, data []byte) {
	t.Helper()
	tmp := filepath.Join(l.dir, fmt.Sprintf(".%s.%d", name, l.rank))
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(l.dir, name)); err != nil {
		t.Fatal(err)
	}
}

func (l link) get(t testing.TB, name string) []byte {
	t.Helper()
	deadline := time.Now().Add(transporttest.Limit)
	for {
		b, err := os.ReadFile(filepath.Join(l.dir, name))
		if err == nil {
			return b
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank %d: %s not written by the other rank after %v", l.rank, name, transporttest.Limit)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// fillSeed fills pieces with the bytes of a PCG stream of seed.
func fillSeed(seed uint64, pieces [][]byte) {
	rng := rand.New(rand.NewPCG(seed, seed^0x5bd1e995))
	for _, p := range pieces {
		for i := range p {
			p[i] = byte(rng.Uint32())
		}
	}
}

func cut(sizes []int) [][]byte {
	out := make([][]byte, len(sizes))
	for i, n := range sizes {
		out[i] = make([]byte, n)
	}
	return out
}

func flat(pieces [][]byte) []byte { return bytes.Join(pieces, nil) }

// TestCrossRank moves data between ranks 0 and 1, both ways, contiguous
// and scattered (differently cut on each side), and checks every byte.
func TestCrossRank(t *testing.T) {
	l := crossRanks(t)
	tr := open(t)
	l.put(t, "up-"+strconv.Itoa(l.rank), nil)
	l.get(t, "up-"+strconv.Itoa(1-l.rank))
	cases := []struct {
		name     string
		src, dst []int
	}{
		{"1B", []int{1}, []int{1}},
		{"4KiB+3", []int{4<<10 + 3}, []int{4<<10 + 3}},
		{"1MiB", []int{1 << 20}, []int{1 << 20}},
		{"scattered", []int{7, 0, 65537, 3<<20 + 5, 13, 5<<20 - 3}, []int{4099, 0, 2<<20 + 1, 3, 6352912}},
		{"64MiB+5", []int{64<<20 + 5}, []int{32 << 20, 32<<20 + 5}},
	}
	for i, c := range cases {
		for from := range 2 {
			step := fmt.Sprintf("%d-%d", i, from)
			seed := uint64(i*2 + from + 1)
			if l.rank == from {
				src := cut(c.src)
				fillSeed(seed, src)
				d := l.get(t, "desc-"+step)
				ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
				err := tr.Send(ctx, d, src)
				cancel()
				if err != nil {
					t.Fatalf("%s: rank %d: Send: %v", c.name, l.rank, err)
				}
				if got := string(l.get(t, "ok-"+step)); got != "ok" {
					t.Fatalf("%s: rank %d: the receiver says: %s", c.name, l.rank, got)
				}
				continue
			}
			dst := cut(c.dst)
			r, err := tr.Expect(dst)
			if err != nil {
				t.Fatal(err)
			}
			l.put(t, "desc-"+step, r.Descriptor())
			select {
			case <-r.Done():
			case <-time.After(transporttest.Limit):
				r.Cancel()
				l.put(t, "ok-"+step, []byte("receipt not done"))
				t.Fatalf("%s: rank %d: receipt not done after %v", c.name, l.rank, transporttest.Limit)
			}
			want := cut(c.src)
			fillSeed(seed, want)
			msg := "ok"
			if err := r.Err(); err != nil {
				msg = err.Error()
			} else if !bytes.Equal(flat(dst), flat(want)) {
				msg = "bytes differ"
			}
			l.put(t, "ok-"+step, []byte(msg))
			if msg != "ok" {
				t.Fatalf("%s: rank %d: %s", c.name, l.rank, msg)
			}
		}
	}
}

// TestCrossRankRefusals: a Send to a cancelled receipt of the other rank
// fails with ErrReceiptGone, and one to a closed transport of the other
// rank with transport.ErrPeerLost; the transport stays usable.
func TestCrossRankRefusals(t *testing.T) {
	l := crossRanks(t)
	tr := open(t)
	send := func(d []byte, n int) error {
		ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
		defer cancel()
		return tr.Send(ctx, d, [][]byte{make([]byte, n)})
	}
	if l.rank == 1 {
		r, err := tr.Expect([][]byte{make([]byte, 1<<20)})
		if err != nil {
			t.Fatal(err)
		}
		r.Cancel()
		l.put(t, "cancelled", r.Descriptor())
		other := open(t)
		r2, err := other.Expect([][]byte{make([]byte, 100)})
		if err != nil {
			t.Fatal(err)
		}
		other.Close()
		l.put(t, "closed", r2.Descriptor())
		dst := [][]byte{make([]byte, 5<<20)}
		r3, err := tr.Expect(dst)
		if err != nil {
			t.Fatal(err)
		}
		l.put(t, "healthy", r3.Descriptor())
		select {
		case <-r3.Done():
		case <-time.After(transporttest.Limit):
			r3.Cancel()
			t.Fatal("rank 1: receipt after the refusals not done")
		}
		if r3.Err() != nil {
			t.Fatalf("rank 1: receipt after the refusals: %v", r3.Err())
		}
		l.get(t, "finished")
		return
	}
	if err := send(l.get(t, "cancelled"), 1<<20); !errors.Is(err, ErrReceiptGone) {
		t.Errorf("Send to a cancelled receipt of rank 1 = %v, want ErrReceiptGone", err)
	}
	if err := send(l.get(t, "closed"), 100); !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("Send to a closed transport of rank 1 = %v, want ErrPeerLost", err)
	}
	if err := send(l.get(t, "healthy"), 5<<20); err != nil {
		t.Errorf("Send after the refusals: %v", err)
	}
	l.put(t, "finished", nil)
}

// TestCrossRankEarlyEnds ends transfers between the ranks early, from
// either side, in the middle: the receiver cancels (the sender's frames in
// flight are drained into scratch memory; dst is not written after
// Cancel), the sender's ctx ends (the receipt fails with ErrAborted), the
// receiving transport closes (the Send fails with ErrPeerLost). After each,
// transfers both ways still work.
func TestCrossRankEarlyEnds(t *testing.T) {
	l := crossRanks(t)
	tr := open(t)
	const n = 64 << 20
	src := make([]byte, n)
	fillSeed(7, [][]byte{src})
	healthy := func(step string) {
		t.Helper()
		for from := range 2 {
			st := fmt.Sprintf("%s-healthy-%d", step, from)
			if l.rank == from {
				ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
				err := tr.Send(ctx, l.get(t, "desc-"+st), [][]byte{src[:5<<20]})
				cancel()
				if err != nil {
					t.Fatalf("%s: rank %d: Send after: %v", step, l.rank, err)
				}
				continue
			}
			dst := make([]byte, 5<<20)
			r, err := tr.Expect([][]byte{dst})
			if err != nil {
				t.Fatal(err)
			}
			l.put(t, "desc-"+st, r.Descriptor())
			select {
			case <-r.Done():
			case <-time.After(transporttest.Limit):
				r.Cancel()
				t.Fatalf("%s: rank %d: receipt after not done", step, l.rank)
			}
			if r.Err() != nil || !bytes.Equal(dst, src[:5<<20]) {
				t.Fatalf("%s: rank %d: receipt after: %v (or bytes differ)", step, l.rank, r.Err())
			}
		}
	}
	for _, step := range []string{"receiver-cancels", "sender-cancels", "receiver-closes"} {
		if l.rank == 1 { // the receiver
			rt := tr
			if step == "receiver-closes" {
				rt = open(t)
			}
			dst := make([]byte, n)
			r, err := rt.Expect([][]byte{dst})
			if err != nil {
				t.Fatal(err)
			}
			l.put(t, "desc-"+step, r.Descriptor())
			l.get(t, "started-"+step)
			time.Sleep(2 * time.Millisecond)
			switch step {
			case "receiver-cancels":
				r.Cancel()
				if err := r.Err(); err != nil && !errors.Is(err, transport.ErrCanceled) {
					t.Errorf("%s: Err after Cancel = %v, want nil or ErrCanceled", step, err)
				}
				for i := range dst { // the caller owns dst again
					dst[i] = 0xa5
				}
			case "receiver-closes":
				rt.Close()
			}
			select {
			case <-r.Done():
			case <-time.After(transporttest.Limit):
				t.Fatalf("%s: receipt not done after %v", step, transporttest.Limit)
			}
			sent := string(l.get(t, "sent-"+step))
			switch err := r.Err(); {
			case step == "sender-cancels" && sent != "ok" && !errors.Is(err, transport.ErrAborted):
				t.Errorf("%s: receipt of a cancelled Send = %v, want ErrAborted", step, err)
			case step == "sender-cancels" && sent == "ok" && err != nil:
				t.Errorf("%s: the Send finished but the receipt failed: %v", step, err)
			case step == "receiver-closes" && err != nil && !errors.Is(err, net.ErrClosed):
				t.Errorf("%s: receipt on a closed transport = %v, want net.ErrClosed", step, err)
			}
			healthy(step)
			if step == "receiver-cancels" && !bytes.Equal(dst, bytes.Repeat([]byte{0xa5}, n)) {
				t.Errorf("%s: dst written after Cancel returned", step)
			}
			continue
		}
		d := l.get(t, "desc-"+step)
		ctx, cancel := context.WithTimeout(context.Background(), transporttest.Limit)
		res := make(chan error, 1)
		go func() { res <- tr.Send(ctx, d, [][]byte{src}) }()
		l.put(t, "started-"+step, nil)
		if step == "sender-cancels" {
			time.Sleep(2 * time.Millisecond)
			cancel()
		}
		var err error
		select {
		case err = <-res:
		case <-time.After(transporttest.Limit + time.Second):
			t.Fatalf("%s: Send not returned", step)
		}
		cancel()
		msg := "ok"
		if err != nil {
			msg = err.Error()
		}
		l.put(t, "sent-"+step, []byte(msg))
		switch {
		case step == "sender-cancels" && err != nil && !errors.Is(err, context.Canceled):
			t.Errorf("%s: Send = %v, want nil or context.Canceled", step, err)
		case step == "receiver-closes" && err != nil && !errors.Is(err, transport.ErrPeerLost):
			t.Errorf("%s: Send = %v, want nil or ErrPeerLost", step, err)
		case step == "receiver-cancels" && err != nil && !errors.Is(err, ErrReceiptGone):
			t.Errorf("%s: Send = %v, want nil or ErrReceiptGone", step, err)
		}
		t.Logf("%s: Send: %v", step, err)
		healthy(step)
	}
}

// BenchmarkCrossRank measures rank 0 sending to rank 1: each iteration
// moves a batch of concurrent transfers (64 of 64 KiB, 1 of 512 MiB, and
// so on: 16 MiB or one message), whose descriptors rank 1 hands over
// (outside the timer). Both ranks must loop the same number of times: run
// it with a fixed -test.benchtime=Nx,
//
//	mpirun -np 2 ./mpi.test -test.run '^$' -test.bench CrossRank -test.benchtime 20x
//
// KVXFER_MPI_BW_FRAME sets the receipts' frame size (default the
// package's FrameBytes); the memory is registered (huge pages)
// unless KVXFER_MPI_BW_PAGES=small. testdata/bw.c is the same in plain C
// MPI, on malloc's pages; bench's mpi_c baseline also runs on huge pages.
func BenchmarkCrossRank(b *testing.B) {
	for _, n := range []int{64 << 10, 512 << 20} {
		b.Run(sizeName(n), func(b *testing.B) { benchCrossRank(b, n) })
	}
}

func benchCrossRank(b *testing.B, n int) {
	if !benchtimeFixed() {
		b.Skip("needs a fixed iteration count on both ranks: -test.benchtime=Nx")
	}
	l := crossRanks(b)
	var opts transport.Options
	if fb := os.Getenv("KVXFER_MPI_BW_FRAME"); fb != "" {
		v, err := parseSize(fb)
		if err != nil {
			b.Fatal(err)
		}
		opts.FrameBytes = v
	}
	tr, err := transport.Open(context.Background(), "mpi", opts)
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Close()
	conc := max(1, min(64, (16<<20)/n))
	src := make([]byte, n)
	dst := cut(slices.Repeat([]int{n}, conc))
	// Registered, as the transceiver registers its pools (huge pages),
	// unless KVXFER_MPI_BW_PAGES=small; then written, so that no side
	// reads the kernel's zero page or faults in the measured loop.
	if os.Getenv("KVXFER_MPI_BW_PAGES") != "small" {
		for _, m := range append([][]byte{src}, dst...) {
			if err := tr.(transport.MemoryRegistrar).RegisterMemory(m, nil); err != nil {
				b.Fatal(err)
			}
		}
	}
	fillSeed(1, [][]byte{src})
	fillSeed(2, dst)
	b.SetBytes(int64(n) * int64(conc))
	round := 0
	for b.Loop() {
		b.StopTimer()
		step := strconv.Itoa(round)
		round++
		if l.rank == 1 {
			rs := make([]transport.Recv, conc)
			var descs [][]byte
			for i := range rs {
				if rs[i], err = tr.Expect(dst[i : i+1]); err != nil {
					b.Fatal(err)
				}
				descs = append(descs, rs[i].Descriptor())
			}
			l.put(b, "bw-"+step, bytes.Join(descs, nil))
			b.StartTimer()
			for _, r := range rs {
				<-r.Done()
				if r.Err() != nil {
					b.Fatal(r.Err())
				}
			}
			continue
		}
		all := l.get(b, "bw-"+step)
		b.StartTimer()
		var wg sync.WaitGroup
		for i := range conc {
			d := all[i*descLen : (i+1)*descLen]
			wg.Go(func() {
				if err := tr.Send(context.Background(), d, [][]byte{src}); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
	}
}

// benchtimeFixed reports whether -test.benchtime is an iteration count.
func benchtimeFixed() bool {
	f := flag.Lookup("test.benchtime")
	return f != nil && strings.HasSuffix(f.Value.String(), "x")
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return strconv.Itoa(n>>20) + "MiB"
	}
	return strconv.Itoa(n>>10) + "KiB"
}

func parseSize(s string) (int, error) {
	mult := 1
	switch {
	case strings.HasSuffix(s, "KiB"):
		mult, s = 1<<10, strings.TrimSuffix(s, "KiB")
	case strings.HasSuffix(s, "MiB"):
		mult, s = 1<<20, strings.TrimSuffix(s, "MiB")
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("size %q: want N, NKiB or NMiB", s)
	}
	return n * mult, nil
}
