package receipt

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/internal/memcopy"

	"github.com/kvxfer/kvxfer/transport"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var testFormat = &Format{
	Backend: "test",
	Header:  []byte{'t', 1},
	CheckHeader: func(b []byte) error {
		if len(b) < 2 || b[0] != 't' || b[1] != 1 {
			return errors.New("not a test descriptor")
		}
		return nil
	},
	CheckEndpoint: func(ep string) error {
		if ep == "" {
			return errors.New("empty endpoint")
		}
		return nil
	},
}

// shapes are dst layouts: lengths of the pieces, empty ones included.
var shapes = [][]int{{1}, {100}, {0, 5}, {3, 0, 0, 4, 0}, {1, 1, 1, 1}, {7, 64, 0, 1, 33}}

func makeDst(lens []int) [][]byte {
	dst := make([][]byte, len(lens))
	for i, n := range lens {
		dst[i] = make([]byte, n)
	}
	return dst
}

// TestPieces checks Slice, Append and CopyAt against the concatenation of
// the pieces, at every offset and length.
func TestPieces(t *testing.T) {
	for _, lens := range shapes {
		t.Run(fmt.Sprint(lens), func(t *testing.T) {
			src := makeDst(lens)
			k := byte(1)
			for _, b := range src {
				for i := range b {
					b[i], k = k, k+1
				}
			}
			flat := bytes.Join(src, nil)
			p, total := MakePieces(src)
			if total != int64(len(flat)) {
				t.Fatalf("total %d, want %d", total, len(flat))
			}
			for off := int64(0); off < total; off++ {
				for n := int64(1); off+n <= total; n++ {
					s := p.Slice(off, n)
					if len(s) == 0 || int64(len(s)) > n || !bytes.Equal(s, flat[off:off+int64(len(s))]) {
						t.Fatalf("Slice(%d, %d) = %v, want a non-empty prefix of %v", off, n, s, flat[off:off+n])
					}
					vec := p.Append(nil, off, n)
					for _, v := range vec {
						if len(v) == 0 {
							t.Fatalf("Append(%d, %d) has an empty slice", off, n)
						}
					}
					if got := bytes.Join(vec, nil); !bytes.Equal(got, flat[off:off+n]) {
						t.Fatalf("Append(%d, %d) = %v, want %v", off, n, got, flat[off:off+n])
					}
					dst := makeDst(lens)
					q, _ := MakePieces(dst)
					q.CopyAt(off, flat[off:off+n])
					want := make([]byte, total)
					copy(want[off:], flat[off:off+n])
					if got := bytes.Join(dst, nil); !bytes.Equal(got, want) {
						t.Fatalf("CopyAt(%d, %d bytes) = %v, want %v", off, n, got, want)
					}
				}
			}
		})
	}
}

func TestFormat(t *testing.T) {
	good := Descriptor{Endpoint: "here", Tag: 7, Total: 1 << 40}
	b := testFormat.Encode(good)
	if d, err := testFormat.Decode(b); err != nil || d != good {
		t.Fatalf("round trip: %+v, %v", d, err)
	}
	bad := map[string][]byte{
		"empty":       {},
		"too long":    make([]byte, transport.MaxDescriptorBytes+1),
		"header":      append([]byte{'u'}, b[1:]...),
		"truncated":   b[:len(b)-1],
		"extended":    append(b, 0),
		"endpoint":    testFormat.Encode(Descriptor{Endpoint: "", Tag: 1, Total: 1}),
		"zero tag":    testFormat.Encode(Descriptor{Endpoint: "x", Tag: 0, Total: 1}),
		"zero total":  testFormat.Encode(Descriptor{Endpoint: "x", Tag: 1, Total: 0}),
		"total < 0":   testFormat.Encode(Descriptor{Endpoint: "x", Tag: 1, Total: -1}),
		"header only": {'t', 1},
	}
	for name, b := range bad {
		if _, err := testFormat.Decode(b); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("%s: err = %v, want ErrBadDescriptor", name, err)
		} else if !bytes.HasPrefix([]byte(err.Error()), []byte("test: ")) {
			t.Errorf("%s: err = %q, want it to name the backend", name, err)
		}
	}
}

func FuzzFormat(f *testing.F) {
	f.Add([]byte(testFormat.Encode(Descriptor{Endpoint: "here", Tag: 7, Total: 9})))
	f.Add([]byte{})
	f.Add([]byte{'t', 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := testFormat.Decode(b)
		if err != nil {
			if !errors.Is(err, transport.ErrBadDescriptor) {
				t.Fatalf("error %v does not wrap ErrBadDescriptor", err)
			}
			return
		}
		if d.Tag == 0 || d.Total <= 0 || d.Endpoint == "" {
			t.Fatalf("accepted %+v", d)
		}
		if !bytes.Equal(testFormat.Encode(d), b) {
			t.Fatalf("re-encoding %+v differs from the input", d)
		}
	})
}

type fill struct{ n int }

func newTable(c Config[fill]) (*Table[fill], *sync.Mutex) {
	mu := new(sync.Mutex)
	c.Format, c.Endpoint, c.Lock = testFormat, "here", mu
	return NewTable(c), mu
}

// expect arms a receipt of n bytes in two pieces.
func expect(t *testing.T, tb *Table[fill], n int) *Recv[fill] {
	t.Helper()
	r, err := tb.Expect([][]byte{make([]byte, n/2), make([]byte, n-n/2)})
	if err != nil {
		t.Fatal(err)
	}
	return r.(*Recv[fill])
}

func done(r interface{ Done() <-chan struct{} }) bool {
	select {
	case <-r.Done():
		return true
	default:
		return false
	}
}

func TestTable(t *testing.T) {
	tb, mu := newTable(Config[fill]{})
	if _, err := tb.Expect([][]byte{{}, nil}); err == nil {
		t.Error("Expect of 0 bytes succeeded")
	}
	r := expect(t, tb, 7)
	d, err := testFormat.Decode(r.Descriptor())
	if err != nil || d.Endpoint != "here" || d.Total != 7 || d.Total != r.Total() {
		t.Fatalf("descriptor %+v, %v", d, err)
	}
	mu.Lock()
	if tb.LookupLocked(d.Tag) != r {
		t.Fatal("receipt not found under its tag")
	}
	r.Fill.n = 1
	r.HoldLocked()
	r.FinishLocked(nil)
	r.FinishLocked(errors.New("later")) // no effect: it has ended
	if !r.Ended() || tb.LookupLocked(d.Tag) != nil {
		t.Fatal("a finished receipt is still armed")
	}
	mu.Unlock()
	if done(r) || r.Err() != nil {
		t.Fatal("Done closed while a writer holds dst")
	}
	mu.Lock()
	r.ReleaseLocked()
	mu.Unlock()
	if !done(r) || r.Err() != nil {
		t.Fatalf("after the release: done %v, Err %v", done(r), r.Err())
	}
	r.Cancel() // after Done: nothing
	if r.Err() != nil {
		t.Fatalf("Cancel after success changed Err to %v", r.Err())
	}

	r2, _ := tb.Expect([][]byte{make([]byte, 1)})
	r2.Cancel()
	if !errors.Is(r2.Err(), transport.ErrCanceled) {
		t.Fatalf("cancelled: Err %v", r2.Err())
	}

	r3, _ := tb.Expect([][]byte{make([]byte, 1)})
	mu.Lock()
	tb.CloseLocked()
	n := 0
	for r := range tb.AllLocked() {
		r.FinishLocked(&transport.ClosedError{Op: "receive"})
		n++
	}
	mu.Unlock()
	if n != 1 || !errors.Is(r3.Err(), net.ErrClosed) {
		t.Fatalf("closing: %d receipts, Err %v", n, r3.Err())
	}
	if _, err := tb.Expect([][]byte{make([]byte, 1)}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Expect after CloseLocked: %v", err)
	}
}

// TestCancelHooks: Cancel interrupts a writer that holds dst, and calls
// Stuck once the grace has passed with the writer still holding it.
func TestCancelHooks(t *testing.T) {
	var interrupted, stuck int
	var tb *Table[fill]
	var mu *sync.Mutex
	tb, mu = newTable(Config[fill]{
		Interrupt: func(*Recv[fill]) { interrupted++ },
		Grace:     10 * time.Millisecond,
		Stuck: func(r *Recv[fill]) {
			mu.Lock()
			stuck++
			r.ReleaseLocked() // what closing the writer's connection leads to
			mu.Unlock()
		},
	})
	r := expect(t, tb, 8)
	mu.Lock()
	r.HoldLocked()
	mu.Unlock()
	r.Cancel()
	if interrupted != 1 || stuck != 1 || !errors.Is(r.Err(), transport.ErrCanceled) {
		t.Fatalf("interrupted %d, stuck %d, Err %v", interrupted, stuck, r.Err())
	}

	// A writer that lets go within the grace: no Stuck.
	r = expect(t, tb, 8)
	mu.Lock()
	r.HoldLocked()
	mu.Unlock()
	go func() {
		time.Sleep(time.Millisecond)
		mu.Lock()
		r.ReleaseLocked()
		mu.Unlock()
	}()
	r.Cancel()
	if interrupted != 2 || stuck != 1 {
		t.Fatalf("interrupted %d, stuck %d", interrupted, stuck)
	}
}

func TestOutcome(t *testing.T) {
	o := MakeOutcome()
	if done(&o) || o.Err() != nil {
		t.Fatal("a new outcome has ended")
	}
	want := errors.New("why")
	o.End(want)
	if !done(&o) || o.Err() != want {
		t.Fatalf("ended: done %v, Err %v", done(&o), o.Err())
	}
}

func TestRand64(t *testing.T) {
	seen := map[uint64]bool{}
	for range 100 {
		v := Rand64()
		if v == 0 || seen[v] {
			t.Fatalf("Rand64 = %d (repeated or zero)", v)
		}
		seen[v] = true
	}
}

// TestPiecesCopyAtStream checks CopyAt into pieces past memcopy.StreamMin,
// where short copies take non-temporal stores: many odd-sized pieces,
// copies at odd offsets and lengths, compared with the flat reference.
func TestPiecesCopyAtStream(t *testing.T) {
	var lens []int
	for total := 0; total < memcopy.StreamMin+5000; {
		n := 1 + (len(lens)*7919)%40000
		lens, total = append(lens, n), total+n
	}
	r := rand.New(rand.NewPCG(3, 4))
	for range 20 {
		dst := makeDst(lens)
		p, total := MakePieces(dst)
		off := r.Int64N(total)
		n := 1 + r.Int64N(total-off)
		src := make([]byte, n)
		for i := range src {
			src[i] = byte(r.Uint32() | 1)
		}
		p.CopyAt(off, src)
		want := make([]byte, total)
		copy(want[off:], src)
		if got := bytes.Join(dst, nil); !bytes.Equal(got, want) {
			t.Fatalf("CopyAt(%d, %d bytes) into %d pieces of %d bytes differs from the reference", off, n, len(lens), total)
		}
	}
}
