//go:build mpi && cgo

package mpi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
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
func crossRanks(t *testing.T) link {
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
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("kvxfer-mpitest-%x", w.epoch), t.Name())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	l := link{dir: dir, rank: w.rank}
	// Rank 1 says it has read all it will read; rank 0 then removes the
	// directory of the test.
	t.Cleanup(func() {
		if l.rank == 1 {
			l.put(t, "end", nil)
			return
		}
		l.get(t, "end")
		os.RemoveAll(dir)
		os.Remove(filepath.Dir(dir)) // once no other test's directory is in it
	})
	return l
}

func (l link) put(t *testing.T, name string, data []byte) {
	t.Helper()
	tmp := filepath.Join(l.dir, fmt.Sprintf(".%s.%d", name, l.rank))
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(l.dir, name)); err != nil {
		t.Fatal(err)
	}
}

func (l link) get(t *testing.T, name string) []byte {
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

// TestCrossRankBandwidth measures rank 0 sending to rank 1 at the sizes of
// KVXFER_MPI_BW (for example "64KiB,512MiB"; unset: skipped), in rounds of
// concurrent transfers that move at least 256 MiB per size, and logs
// GB/s; KVXFER_MPI_BW_FRAME sets the frame size (default
// transport.DefaultFrameBytes). Compare with testdata/bw.c, the same sizes
// in plain C MPI.
func TestCrossRankBandwidth(t *testing.T) {
	spec := os.Getenv("KVXFER_MPI_BW")
	if spec == "" {
		t.Skip("set KVXFER_MPI_BW=64KiB,512MiB to measure")
	}
	l := crossRanks(t)
	var opts transport.Options
	if fb := os.Getenv("KVXFER_MPI_BW_FRAME"); fb != "" { // the receiver's frame size
		n, err := parseSize(fb)
		if err != nil {
			t.Fatal(err)
		}
		opts.FrameBytes = n
	}
	tr, err := transport.Open(context.Background(), "mpi", opts)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	for _, s := range strings.Split(spec, ",") {
		n, err := parseSize(s)
		if err != nil {
			t.Fatal(err)
		}
		conc := max(1, min(64, (16<<20)/n))
		rounds := max(3, (256<<20)/(n*conc))
		src := make([]byte, n)
		fillSeed(1, [][]byte{src})
		var busy time.Duration
		for round := range rounds + 1 { // round 0 warms up
			step := fmt.Sprintf("%s-%d", s, round)
			if l.rank == 1 {
				rs := make([]transport.Recv, conc)
				var descs [][]byte
				for i := range rs {
					if rs[i], err = tr.Expect([][]byte{make([]byte, n)}); err != nil {
						t.Fatal(err)
					}
					descs = append(descs, rs[i].Descriptor())
				}
				l.put(t, "bw-"+step, bytes.Join(descs, nil))
				for _, r := range rs {
					<-r.Done()
					if r.Err() != nil {
						t.Fatal(r.Err())
					}
				}
				continue
			}
			all := l.get(t, "bw-"+step)
			start := time.Now()
			var wg sync.WaitGroup
			for i := range conc {
				d := all[i*descLen : (i+1)*descLen]
				wg.Go(func() {
					if err := tr.Send(context.Background(), d, [][]byte{src}); err != nil {
						t.Error(err)
					}
				})
			}
			wg.Wait()
			if round > 0 {
				busy += time.Since(start)
			}
		}
		if l.rank == 0 {
			bytes := float64(n) * float64(conc) * float64(rounds)
			t.Logf("mpi transport: %s messages, %d at once, %d rounds: %.2f GB/s", s, conc, rounds, bytes/busy.Seconds()/1e9)
		}
	}
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
