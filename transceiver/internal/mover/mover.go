package mover

import (
	"context"

	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
)

// Pair is what one send or receive of a pair of ranks moves, and over
// what.
type Pair struct {
	Transport transport.Transport
	// Blocks are the pair's blocks on this side, in request order: the
	// sender's to read, the receiver's to fill.
	Blocks [][]byte
	// Plan maps the sender's blocks to the receiver's (its packed form is
	// what crosses the wire).
	Plan *layout.Plan
	// Chunk is the blocks per staged chunk (≥ 1; unused when direct).
	Chunk int
	// Buffers are the staging buffers of this side.
	Buffers *Buffers
	// Owner is the request the pair is part of, for the buffers' hold
	// limit: a transfer never stops another of the same owner to take its
	// buffer (see Buffers).
	Owner any
	// Scatter, on the receiving side of a staged transfer, arms each
	// chunk's receipt straight into the blocks' spans (vectored) instead of
	// into a staging buffer to unpack: the sender sends the same bytes
	// either way; the receiver makes one copy fewer and holds no buffer.
	// For spans large enough that their per-segment cost is small.
	Scatter bool
	// Gather, on the sending side of a staged transfer, sends each chunk
	// straight from the blocks' spans (vectored) instead of packing it
	// into a staging buffer: the bytes are the same, the sender makes one
	// copy fewer and holds no buffer. For spans large enough that their
	// per-segment cost is small.
	Gather bool
	// Check, when not nil, is asked about every descriptor the receiver
	// handed the sender before anything is sent to it (or a staging buffer
	// taken for it); its error ends the send.
	Check func(transport.Descriptor) error
}

func (p Pair) check(d transport.Descriptor) error {
	if p.Check == nil {
		return nil
	}
	return p.Check(d)
}

// Chunk is the receipt the receiver armed for one staged chunk, as it
// announced it to the sender.
type Chunk struct {
	Index int
	Desc  transport.Descriptor
}

// bytes is the packed size of n blocks.
func (p Pair) bytes(n int) int64 { return int64(n) * p.Plan.PackedBytesPerBlock() }

// Moved is what one send or receive of a pair moved before it ended, and
// over which backend.
type Moved struct {
	Bytes  int64
	Chunks int
	// Backend is the transport's name read after the move: ucx names the
	// transport that carried it.
	Backend string
	Err     error // nil: every byte moved
}

// Send sends the blocks: straight to the receipt the receiver armed with
// ExpectDirect when direct is not nil (one chunk), else staged, each
// chunk to the receipt announced for it on chunks (see sendStaged).
func (p Pair) Send(ctx context.Context, direct transport.Descriptor, chunks <-chan Chunk) Moved {
	var m Moved
	if direct == nil {
		m.Bytes, m.Chunks, m.Err = p.sendStaged(ctx, chunks)
	} else if m.Err = p.check(direct); m.Err != nil {
	} else if m.Err = p.Transport.Send(ctx, direct, Segments(p.Blocks, p.Plan.SrcSpans())); m.Err == nil {
		m.Bytes, m.Chunks = p.bytes(len(p.Blocks)), 1
	}
	m.Backend = p.Transport.Name()
	return m
}

// ExpectDirect arms the receipt of a direct transfer straight into the
// blocks; the caller hands its descriptor to the sender and waits with
// AwaitDirect.
func (p Pair) ExpectDirect() (transport.Recv, error) {
	return p.Transport.Expect(Segments(p.Blocks, p.Plan.DstSpans()))
}

// AwaitDirect waits for rv, armed with ExpectDirect, to fill; when ctx
// ends first it cancels rv and returns ctx's cause.
func (p Pair) AwaitDirect(ctx context.Context, rv transport.Recv) Moved {
	m := Moved{Err: Await(ctx, rv)}
	if m.Err != nil {
		rv.Cancel() // a no-op once it has ended
	} else {
		m.Bytes, m.Chunks = p.bytes(len(p.Blocks)), 1
	}
	m.Backend = p.Transport.Name()
	return m
}

// sendStaged sends the blocks chunk by chunk, each to the receipt
// announced for it: gathered from the blocks' spans (Gather), else packed
// into a staging buffer, which it holds until the chunk is sent (a send
// that holds it past the buffers' limit while another waits is stopped:
// see Buffers). chunks yields the announcements in order (the caller
// checks the order). It returns the bytes and chunks sent before it
// ended.
func (p Pair) sendStaged(ctx context.Context, chunks <-chan Chunk) (int64, int, error) {
	var sent int64
	n := 0
	for lo := 0; lo < len(p.Blocks); lo += p.Chunk {
		hi := min(lo+p.Chunk, len(p.Blocks))
		var c Chunk
		select {
		case c = <-chunks:
		case <-ctx.Done():
			return sent, n, context.Cause(ctx)
		}
		if err := p.check(c.Desc); err != nil {
			return sent, n, err
		}
		size := p.bytes(hi - lo)
		var err error
		if p.Gather {
			err = p.Transport.Send(ctx, c.Desc, Segments(p.Blocks[lo:hi], p.Plan.SrcSpans()))
		} else {
			err = p.sendPacked(ctx, c.Desc, p.Blocks[lo:hi], size)
		}
		if err != nil {
			return sent, n, err
		}
		sent += size
		n++
	}
	return sent, n, nil
}

// sendPacked packs blocks (size bytes packed) into a staging buffer and
// sends it to desc.
func (p Pair) sendPacked(ctx context.Context, desc transport.Descriptor, blocks [][]byte, size int64) error {
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	l, err := p.Buffers.Hold(ctx, Holder{Owner: p.Owner, Bytes: size, Stop: stop})
	if err != nil {
		return err
	}
	defer l.Release()
	if err := p.Plan.Pack(l.Buf[:size], blocks); err != nil {
		return err
	}
	if err := p.Transport.Send(ctx, desc, [][]byte{l.Buf[:size]}); err != nil {
		if held := l.Err(); held != nil {
			return held // stopped for holding the buffer: say so, not "cancelled"
		}
		return err
	}
	return nil
}

// Receive receives the chunks of a staged transfer, keeping up to two in
// flight (when there are two buffers, or it scatters): for each, a
// receipt announced to the sender (announce), into a buffer and, once it
// is in, unpacked into the blocks; or, with Scatter, straight into the
// blocks.
func (p Pair) Receive(ctx context.Context, announce func(Chunk) error) Moved {
	var m Moved
	m.Bytes, m.Chunks, m.Err = p.receiveStaged(ctx, announce)
	m.Backend = p.Transport.Name()
	return m
}

func (p Pair) receiveStaged(ctx context.Context, announce func(Chunk) error) (int64, int, error) {
	ctx, stop := context.WithCancelCause(ctx) // stop: a buffer held too long (see Buffers)
	defer stop(nil)
	depth := 2
	if !p.Scatter {
		depth = min(depth, p.Buffers.Count())
	}
	w := window{p: p, ctx: ctx, stop: stop, announce: announce, depth: depth}
	defer w.cancel()
	total := (len(p.Blocks) + p.Chunk - 1) / p.Chunk
	var got int64
	for done := 0; done < total; done++ {
		if err := w.fill(total); err != nil {
			return got, done, err
		}
		n, err := w.take()
		if err != nil {
			return got, done, err
		}
		got += n
	}
	return got, total, nil
}

// Await waits for rv to end: its error, or ctx's cause when ctx ends
// first (rv is then still armed).
func Await(ctx context.Context, rv transport.Recv) error {
	select {
	case <-rv.Done():
		return rv.Err()
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// Segments returns the spans of every block, in order: the byte stream of
// a direct transfer is the packed form, which both span lists describe.
func Segments(blocks [][]byte, spans []layout.Span) [][]byte {
	out := make([][]byte, 0, len(blocks)*len(spans))
	for _, b := range blocks {
		for _, s := range spans {
			out = append(out, b[s.Off:s.Off+s.Len:s.Off+s.Len])
		}
	}
	return out
}

// window is the chunks of one staged receive in flight, oldest first.
type window struct {
	p        Pair
	ctx      context.Context
	stop     context.CancelCauseFunc
	announce func(Chunk) error
	depth    int
	next     int // index of the next chunk to announce
	flight   []slot
}

type slot struct {
	buf    *Lease // nil: scattered into the blocks
	rv     transport.Recv
	lo, hi int // blocks
}

// fill announces chunks until depth are in flight, waiting for a buffer
// only when none is. A buffer is held until its chunk is unpacked, so its
// hold covers the chunks ahead of it in flight as well as its own.
func (w *window) fill(total int) error {
	for w.next < total && len(w.flight) < w.depth {
		lo, hi := w.next*w.p.Chunk, min(len(w.p.Blocks), (w.next+1)*w.p.Chunk)
		if w.p.Scatter {
			rv, err := w.p.Transport.Expect(Segments(w.p.Blocks[lo:hi], w.p.Plan.DstSpans()))
			if err != nil {
				return err
			}
			w.flight = append(w.flight, slot{rv: rv, lo: lo, hi: hi})
			if err := w.announce(Chunk{Index: w.next, Desc: rv.Descriptor()}); err != nil {
				return err
			}
			w.next++
			continue
		}
		n := w.p.bytes(hi - lo)
		for _, sl := range w.flight {
			n += w.p.bytes(sl.hi - sl.lo)
		}
		var l *Lease
		if len(w.flight) == 0 {
			var err error
			if l, err = w.p.Buffers.Hold(w.ctx, Holder{Owner: w.p.Owner, Bytes: n, Stop: w.stop}); err != nil {
				return err
			}
		} else if l2, ok := w.p.Buffers.TryHold(Holder{Owner: w.p.Owner, Bytes: n, Stop: w.stop}); ok {
			l = l2
		} else {
			return nil
		}
		rv, err := w.p.Transport.Expect([][]byte{l.Buf[:w.p.bytes(hi-lo)]})
		if err != nil {
			l.Release()
			return err
		}
		w.flight = append(w.flight, slot{buf: l, rv: rv, lo: lo, hi: hi})
		if err := w.announce(Chunk{Index: w.next, Desc: rv.Descriptor()}); err != nil {
			return err
		}
		w.next++
	}
	return nil
}

// take waits for the oldest chunk and unpacks it into the blocks.
func (w *window) take() (int64, error) {
	head := w.flight[0]
	if err := Await(w.ctx, head.rv); err != nil {
		return 0, err
	}
	size := w.p.bytes(head.hi - head.lo)
	w.flight = w.flight[1:]
	if head.buf == nil {
		return size, nil // scattered: in place already
	}
	err := w.p.Plan.Unpack(w.p.Blocks[head.lo:head.hi], head.buf.Buf[:size])
	head.buf.Release()
	if err != nil {
		return 0, err
	}
	return size, nil
}

// cancel gives back what is still in flight.
func (w *window) cancel() {
	for _, sl := range w.flight {
		sl.rv.Cancel()
		if sl.buf != nil {
			sl.buf.Release()
		}
	}
	w.flight = nil
}
