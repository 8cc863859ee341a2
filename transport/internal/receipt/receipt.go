package receipt

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"iter"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// Config configures a Table.
type Config[F any] struct {
	// Format is the backend's descriptor format; its Backend names the
	// backend in errors ("tcp").
	Format *Format
	// Endpoint is the Transport's, embedded in every descriptor.
	Endpoint string
	// Lock is the lock of the Transport, which guards the table and the
	// guarded fields of its receipts (Fill among them).
	Lock sync.Locker
	// Interrupt, when set, is called (Lock held) when a receipt ends while
	// writers hold it, so that they let go promptly (tcp sets a read
	// deadline in the past on the connections reading into it).
	Interrupt func(r *Recv[F])
	// Stuck, when set, is called by Cancel (Lock not held) when writers
	// still hold the receipt Grace after Cancel ended it: the last resort
	// (tcp closes their connections). Without it Cancel waits as long as
	// the writers take, which must then be bounded by themselves.
	Stuck func(r *Recv[F])
	Grace time.Duration
}

// Table is the armed receipts of one Transport, by tag. Make it with
// NewTable. It is guarded by Config.Lock.
type Table[F any] struct {
	c      Config[F]
	recvs  map[uint64]*Recv[F]
	closed bool
}

// NewTable returns an empty table.
func NewTable[F any](c Config[F]) *Table[F] {
	return &Table[F]{c: c, recvs: make(map[uint64]*Recv[F])}
}

// Expect arms a receipt of sum(len(dst[i])) bytes, laid out in order over
// dst, under a fresh random tag: the Expect of a backend. The Recv it
// returns is a *Recv[F]. It fails when the total is 0, and with a
// *transport.ClosedError after CloseLocked.
func (tb *Table[F]) Expect(dst [][]byte) (transport.Recv, error) {
	pieces, total := MakePieces(dst)
	if total == 0 {
		return nil, fmt.Errorf("%s: expect: nothing to receive (total length 0)", tb.c.Format.Backend)
	}
	r := &Recv[F]{Outcome: MakeOutcome(), tb: tb, dst: pieces, total: total}
	tb.c.Lock.Lock()
	if tb.closed {
		tb.c.Lock.Unlock()
		return nil, &transport.ClosedError{Op: "expect"}
	}
	for r.tag == 0 || tb.recvs[r.tag] != nil {
		r.tag = Rand64()
	}
	tb.recvs[r.tag] = r
	tb.c.Lock.Unlock()
	r.desc = tb.c.Format.Encode(Descriptor{Endpoint: tb.c.Endpoint, Tag: r.tag, Total: total})
	return r, nil
}

// CloseLocked makes every later Expect fail with a *transport.ClosedError.
// The receipts armed stay until the backend finishes them (AllLocked).
func (tb *Table[F]) CloseLocked() { tb.closed = true }

// LookupLocked returns the armed receipt of tag, or nil: never armed, or
// ended.
func (tb *Table[F]) LookupLocked(tag uint64) *Recv[F] { return tb.recvs[tag] }

// AllLocked yields every armed receipt; the loop may finish them.
func (tb *Table[F]) AllLocked() iter.Seq[*Recv[F]] {
	return func(yield func(*Recv[F]) bool) {
		for _, r := range tb.recvs {
			if !yield(r) {
				return
			}
		}
	}
}

// Recv is one armed receipt, the transport.Recv of a backend. Fill is the
// backend's own state of the filling of the receipt (the sender bound to
// it, bytes received...), guarded by the table's lock.
type Recv[F any] struct {
	Outcome
	tb    *Table[F]
	tag   uint64
	desc  transport.Descriptor
	dst   Pieces
	total int64
	// ended is set (lock held) when the receipt has ended; writers test it
	// between reads or parts without the lock.
	ended atomic.Bool

	// Guarded by the table's lock, as is Outcome.err, which FinishLocked
	// sets (before Done closes, when writers still hold dst).
	holders int  // writers between taking dst and letting go of it
	closed  bool // Done is closed

	// Fill is the backend's; guarded by the table's lock.
	Fill F
}

var _ transport.Recv = (*Recv[struct{}])(nil)

// Descriptor returns a copy of the receipt's descriptor.
func (r *Recv[F]) Descriptor() transport.Descriptor { return slices.Clone(r.desc) }

// Total returns the length of the receipt in bytes.
func (r *Recv[F]) Total() int64 { return r.total }

// Ended reports whether the receipt has ended (FinishLocked); a writer that
// sees it lets go of dst. Safe without the lock.
func (r *Recv[F]) Ended() bool { return r.ended.Load() }

// ErrLocked returns why the receipt ended (nil: success, or not ended).
func (r *Recv[F]) ErrLocked() error { return r.err }

// HoldLocked records a writer that takes dst: Done waits for its
// ReleaseLocked. The receipt must not have ended.
func (r *Recv[F]) HoldLocked() { r.holders++ }

// ReleaseLocked records a writer that lets go of dst; Done closes when the
// last one does so after the end.
func (r *Recv[F]) ReleaseLocked() {
	if r.holders--; r.holders < 0 {
		panic("receipt: ReleaseLocked without HoldLocked")
	}
	if r.holders == 0 && r.ended.Load() && !r.closed {
		r.closed = true
		close(r.done)
	}
}

// FinishLocked ends the receipt with err (nil: success) unless it has
// ended, and forgets its tag. Done closes now, or when the last writer lets
// go; meanwhile Config.Interrupt is called to hurry them.
func (r *Recv[F]) FinishLocked(err error) {
	if r.ended.Load() {
		return
	}
	r.err = err
	r.ended.Store(true)
	tb := r.tb
	if tb.recvs[r.tag] == r {
		delete(tb.recvs, r.tag)
	}
	if r.holders == 0 {
		r.closed = true
		close(r.done)
		return
	}
	if tb.c.Interrupt != nil {
		tb.c.Interrupt(r)
	}
}

// Cancel ends the receipt with transport.ErrCanceled unless it has ended,
// then waits until no writer holds dst (see Config.Stuck).
func (r *Recv[F]) Cancel() {
	tb := r.tb
	tb.c.Lock.Lock()
	r.FinishLocked(fmt.Errorf("%s: receive: %w", tb.c.Format.Backend, transport.ErrCanceled))
	tb.c.Lock.Unlock()
	if tb.c.Stuck != nil {
		select {
		case <-r.Done():
			return
		default:
		}
		timer := time.NewTimer(tb.c.Grace)
		defer timer.Stop()
		select {
		case <-r.Done():
			return
		case <-timer.C:
		}
		tb.c.Stuck(r)
	}
	<-r.Done()
}

// Dst returns the memory of the receipt.
func (r *Recv[F]) Dst() Pieces { return r.dst }

// Outcome is the end of something that ends once, as transport.Recv
// reports it: Done is closed when it has ended, and Err then says why.
// Make one with MakeOutcome.
type Outcome struct {
	done chan struct{}
	err  error // set before done is closed
}

// MakeOutcome returns an Outcome that has not ended.
func MakeOutcome() Outcome { return Outcome{done: make(chan struct{})} }

// Done is closed when the end is reached.
func (o *Outcome) Done() <-chan struct{} { return o.done }

// Err returns why it failed, or nil: before Done, and on success.
func (o *Outcome) Err() error {
	select {
	case <-o.done:
		return o.err
	default:
		return nil
	}
}

// End records err (nil: success) and closes Done. It must be called once,
// by whoever decides the end (under a lock, or from the one goroutine that
// owns it).
func (o *Outcome) End(err error) {
	o.err = err
	close(o.done)
}

// Rand64 returns a random non-zero value from crypto/rand: tags, and the
// other ids the backends draw (sender sessions, probe nonces).
func Rand64() uint64 {
	var b [8]byte
	for {
		rand.Read(b[:]) // never fails (see crypto/rand.Read)
		if v := binary.BigEndian.Uint64(b[:]); v != 0 {
			return v
		}
	}
}
