package faultinject

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// Transport is a transport.Transport with faults. Its methods are safe for
// concurrent use.
type Transport struct {
	inner transport.Transport
	plan  Plan

	count    [numOps]atomic.Uint64
	injected [numOps][numKinds]atomic.Uint64

	mu   sync.Mutex
	done [numOps]chan struct{} // closed (and replaced) when an operation of the kind completes
	// Sends in an injected delay or hold, until their wrapped Send returns,
	// and the channel Close waits on for them (closed when none is left).
	held     int
	heldZero chan struct{}

	closing   chan struct{} // closed by Close: delays and holds end at once
	closeOnce sync.Once
}

// Wrap returns inner with the faults of plan. Closing the result closes
// inner.
func Wrap(inner transport.Transport, plan Plan) *Transport {
	t := &Transport{inner: inner, plan: plan, closing: make(chan struct{})}
	for i := range t.done {
		t.done[i] = make(chan struct{})
	}
	return t
}

// Inner returns the wrapped transport.
func (t *Transport) Inner() transport.Transport { return t.inner }

// Injected returns how many faults of kind k have hit operation op.
func (t *Transport) Injected(op Op, k Kind) uint64 { return t.injected[op][k].Load() }

// Name is "faulty+" and the wrapped transport's name.
func (t *Transport) Name() string { return "faulty+" + t.inner.Name() }

// Endpoint is the wrapped transport's.
func (t *Transport) Endpoint() string { return t.inner.Endpoint() }

// closeGrace bounds how long Close waits for Sends in an injected delay.
const closeGrace = time.Second

// Close closes the wrapped transport. Sends in an injected delay or hold go
// on to the wrapped Send at once, and Close waits for them (at most
// closeGrace) before closing it: a receipt that a delayed Send is
// addressed to then learns of the Send as it would from the wrapped
// backend alone, rather than never hearing of it.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() { close(t.closing) })
	t.mu.Lock()
	var zero chan struct{}
	if t.held > 0 {
		if t.heldZero == nil {
			t.heldZero = make(chan struct{})
		}
		zero = t.heldZero
	}
	t.mu.Unlock()
	if zero != nil {
		tm := time.NewTimer(closeGrace)
		select {
		case <-zero:
		case <-tm.C:
		}
		tm.Stop()
	}
	return t.inner.Close()
}

// holdSend counts a Send in an injected delay or hold until release.
func (t *Transport) holdSend() (release func()) {
	t.mu.Lock()
	t.held++
	t.mu.Unlock()
	return func() {
		t.mu.Lock()
		if t.held--; t.held == 0 && t.heldZero != nil {
			close(t.heldZero)
			t.heldZero = nil
		}
		t.mu.Unlock()
	}
}

// RegisterMemory passes mem on when the wrapped transport registers memory.
func (t *Transport) RegisterMemory(mem []byte, f *os.File) error {
	if r, ok := t.inner.(transport.MemoryRegistrar); ok {
		return r.RegisterMemory(mem, f)
	}
	return nil
}

// Error is an injected fault's error. It unwraps to Err
// (transport.ErrPeerLost, or the wrapped backend's refusal of a truncated
// Send).
type Error struct {
	Op   Op
	Kind Kind
	N    uint64 // the operation's number on this transport, from 1
	Err  error
}

func (e *Error) Error() string {
	return fmt.Sprintf("faultinject: %s #%d: injected %s: %v", e.Op, e.N, e.Kind, e.Err)
}

// Unwrap returns Err.
func (e *Error) Unwrap() error { return e.Err }

// next numbers an operation and returns the rule that hits it, if any,
// and the channel that the next completion of an operation op closes,
// taken before the number: a hold (reorder) then learns of every
// completion from then on, also one between the numbering and the hold.
func (t *Transport) next(op Op) (uint64, Rule, bool, <-chan struct{}) {
	t.mu.Lock()
	done := t.done[op]
	t.mu.Unlock()
	n := t.count[op].Add(1)
	r, ok := t.plan.Hit(op, n)
	if ok {
		t.injected[op][r.Kind].Add(1)
	}
	return n, r, ok, done
}

// completed wakes the operations of kind op held back for reordering.
func (t *Transport) completed(op Op) {
	t.mu.Lock()
	close(t.done[op])
	t.done[op] = make(chan struct{})
	t.mu.Unlock()
}

// wait waits d, or until ctx ends (false).
func wait(ctx context.Context, d time.Duration, closing <-chan struct{}) bool {
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-closing:
		return true
	case <-ctx.Done():
		return false
	}
}

// hold waits until another operation completes (done, from next), at most
// d, or until ctx ends (false).
func (t *Transport) hold(ctx context.Context, done <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		d = DefaultHold
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-done:
	case <-tm.C:
	case <-t.closing:
	case <-ctx.Done():
		return false
	}
	return true
}

// Send is the wrapped transport's Send, unless a rule hits it.
func (t *Transport) Send(ctx context.Context, desc transport.Descriptor, src [][]byte) error {
	n, r, hit, done := t.next(OpSend)
	defer t.completed(OpSend)
	if !hit {
		return t.inner.Send(ctx, desc, src)
	}
	switch r.Kind {
	case Fail:
		return &Error{Op: OpSend, Kind: Fail, N: n, Err: fmt.Errorf("send to %s: %w", t.inner.Endpoint(), transport.ErrPeerLost)}
	case Delay:
		defer t.holdSend()()
		if !wait(ctx, orDefault(r.Duration, DefaultDelay), t.closing) {
			return &transport.TimeoutError{Op: "send", Peer: "(delayed by faultinject)", Err: ctx.Err()}
		}
	case Reorder:
		defer t.holdSend()()
		if !t.hold(ctx, done, r.Duration) {
			return &transport.TimeoutError{Op: "send", Peer: "(held by faultinject)", Err: ctx.Err()}
		}
	case Truncate:
		short := truncated(src)
		if short == nil {
			return &Error{Op: OpSend, Kind: Truncate, N: n, Err: transport.ErrPeerLost}
		}
		err := t.inner.Send(ctx, desc, short)
		if err == nil {
			// A backend that delivered a short transfer as if it were
			// whole would be a bug of that backend; say so loudly.
			err = fmt.Errorf("backend %s accepted a send one byte short of its descriptor: %w", t.inner.Name(), transport.ErrProtocol)
		}
		return &Error{Op: OpSend, Kind: Truncate, N: n, Err: err}
	}
	return t.inner.Send(ctx, desc, src)
}

// truncated returns src without its last byte, sharing its memory, or nil
// when src holds no byte.
func truncated(src [][]byte) [][]byte {
	out := append([][]byte(nil), src...)
	for i := len(out) - 1; i >= 0; i-- {
		if len(out[i]) > 0 {
			out[i] = out[i][:len(out[i])-1]
			return out
		}
	}
	return nil
}

func orDefault(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// Expect is the wrapped transport's Expect, unless a rule hits it.
func (t *Transport) Expect(dst [][]byte) (transport.Recv, error) {
	n, r, hit, done := t.next(OpExpect)
	defer t.completed(OpExpect)
	if !hit {
		return t.inner.Expect(dst)
	}
	switch r.Kind {
	case Fail:
		return nil, &Error{Op: OpExpect, Kind: Fail, N: n, Err: fmt.Errorf("expect on %s: %w", t.inner.Endpoint(), transport.ErrPeerLost)}
	case Delay:
		time.Sleep(orDefault(r.Duration, DefaultDelay))
	case Reorder:
		t.hold(context.Background(), done, r.Duration)
	case Truncate:
		in, err := t.inner.Expect(dst)
		if err != nil {
			return nil, err
		}
		return newShortRecv(in, dst, n), nil
	}
	return t.inner.Expect(dst)
}

// shortRecv is a receipt that loses its tail: when the wrapped receipt has
// every byte in place, it zeroes the last bytes of dst and fails.
type shortRecv struct {
	in   transport.Recv
	dst  [][]byte
	n    uint64
	done chan struct{}
	err  error
}

// tailBytes is how many bytes a truncated receipt loses (fewer when it
// has fewer).
const tailBytes = 64

func newShortRecv(in transport.Recv, dst [][]byte, n uint64) *shortRecv {
	r := &shortRecv{in: in, dst: dst, n: n, done: make(chan struct{})}
	go func() {
		<-in.Done()
		if err := in.Err(); err != nil {
			r.err = err
		} else {
			lost := zeroTail(dst, tailBytes)
			r.err = &Error{Op: OpExpect, Kind: Truncate, N: n,
				Err: fmt.Errorf("receipt lost its last %d bytes: %w", lost, transport.ErrPeerLost)}
		}
		close(r.done)
	}()
	return r
}

// zeroTail zeroes up to n bytes at the end of dst and returns how many.
func zeroTail(dst [][]byte, n int) int {
	z := 0
	for i := len(dst) - 1; i >= 0 && z < n; i-- {
		b := dst[i]
		k := min(len(b), n-z)
		clear(b[len(b)-k:])
		z += k
	}
	return z
}

func (r *shortRecv) Descriptor() transport.Descriptor { return r.in.Descriptor() }
func (r *shortRecv) Done() <-chan struct{}            { return r.done }

func (r *shortRecv) Err() error {
	select {
	case <-r.done:
		return r.err
	default:
		return nil
	}
}

// Cancel cancels the wrapped receipt and waits until this one has ended,
// so that dst is the caller's again.
func (r *shortRecv) Cancel() {
	r.in.Cancel()
	<-r.done
}

// FromEnv reads a plan from the environment variable EnvPlan through
// getenv and returns a wrapper of data planes with it (the shape of
// transceiver.Options.WrapDataPlane), or nil when the variable is unset or
// empty. A plan that does not parse is an error naming the variable.
func FromEnv(getenv func(string) string) (func(name string, t transport.Transport) transport.Transport, error) {
	v := getenv(EnvPlan)
	if v == "" {
		return nil, nil
	}
	plan, err := ParsePlan(v)
	if err != nil {
		return nil, fmt.Errorf("faultinject: %s: %w", EnvPlan, err)
	}
	return func(_ string, t transport.Transport) transport.Transport { return Wrap(t, plan) }, nil
}
