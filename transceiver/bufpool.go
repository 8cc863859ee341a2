package transceiver

import (
	"context"
	"sync/atomic"
)

// bufPool is a fixed number of staging buffers of one size, allocated on
// first use and reused: the memory a rank spends on staging is bounded by
// count × size whatever the size of the requests (a larger request is
// streamed through in chunks).
type bufPool struct {
	size  int
	slots chan []byte // a nil entry is a buffer not yet allocated
	inUse atomic.Int64
}

func newBufPool(count, size int) *bufPool {
	p := &bufPool{size: size, slots: make(chan []byte, count)}
	for range count {
		p.slots <- nil
	}
	return p
}

// get waits for a free buffer.
func (p *bufPool) get(ctx context.Context) ([]byte, error) {
	select {
	case b := <-p.slots:
		return p.fill(b)
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// tryGet returns a free buffer if there is one now.
func (p *bufPool) tryGet() ([]byte, bool) {
	select {
	case b := <-p.slots:
		b, err := p.fill(b)
		return b, err == nil
	default:
		return nil, false
	}
}

func (p *bufPool) fill(b []byte) ([]byte, error) {
	if b == nil {
		b = make([]byte, p.size)
	}
	p.inUse.Add(1)
	return b, nil
}

// put returns a buffer taken with get or tryGet.
func (p *bufPool) put(b []byte) {
	p.inUse.Add(-1)
	p.slots <- b[:p.size:p.size]
}

// count is the number of buffers.
func (p *bufPool) count() int { return cap(p.slots) }
