package mover

import (
	"context"
	"sync/atomic"
)

// Buffers is a fixed number of staging buffers of one size, allocated on
// first use and reused: the memory a rank spends on staging is bounded by
// count × size whatever the size of the requests (a larger request is
// streamed through in chunks). Its methods may be called from any
// goroutine.
type Buffers struct {
	size      int
	slots     chan []byte // a nil entry is a buffer not yet allocated
	inUse     atomic.Int64
	allocated atomic.Int64
}

// NewBuffers returns count buffers of size bytes, none allocated yet.
func NewBuffers(count, size int) *Buffers {
	p := &Buffers{size: size, slots: make(chan []byte, count)}
	for range count {
		p.slots <- nil
	}
	return p
}

// Get waits for a free buffer, or for ctx to end (its cause).
func (p *Buffers) Get(ctx context.Context) ([]byte, error) {
	select {
	case b := <-p.slots:
		return p.take(b), nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// TryGet returns a free buffer if there is one now.
func (p *Buffers) TryGet() ([]byte, bool) {
	select {
	case b := <-p.slots:
		return p.take(b), true
	default:
		return nil, false
	}
}

func (p *Buffers) take(b []byte) []byte {
	if b == nil {
		b = make([]byte, p.size)
		p.allocated.Add(1)
	}
	p.inUse.Add(1)
	return b
}

// Put returns a buffer taken with Get or TryGet (resliced to its full
// size: the caller may have cut it). Putting back more buffers than were
// taken panics rather than block.
func (p *Buffers) Put(b []byte) {
	select {
	case p.slots <- b[:p.size:p.size]:
		p.inUse.Add(-1)
	default:
		panic("mover: Buffers.Put of a buffer not taken")
	}
}

// Count is the number of buffers.
func (p *Buffers) Count() int { return cap(p.slots) }

// Size is the bytes of one buffer.
func (p *Buffers) Size() int { return p.size }

// InUse is the number of buffers taken and not yet put back.
func (p *Buffers) InUse() int64 { return p.inUse.Load() }

// Allocated is the number of buffers allocated so far (each once: a
// buffer never taken costs no memory).
func (p *Buffers) Allocated() int { return int(p.allocated.Load()) }
