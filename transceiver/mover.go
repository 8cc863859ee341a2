package transceiver

import (
	"context"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// The data mover: one send or receive of a pair of ranks, as the core
// planned it (sendPlan, recvPlan), over the pair's backend. Each runs on
// one of the rank's worker goroutines (rank.spawn) and ends when every
// byte has moved, at the first error, or when the request's context ends.

// registerMemory declares the rank's pool arena to every backend that
// wants memory registered. Staging buffers stay private heap memory: no
// backend hands a peer a pool or a staging buffer (shm copies each part
// into a window of the connection; see transport/shm).
func (r *rank) registerMemory() error {
	arena := r.pool.Arena()
	var f *os.File
	if sa, ok := arena.(*kvcache.ShmArena); ok {
		f = sa.File()
	}
	for _, n := range r.backendNames() {
		if mr, ok := r.transports[n].(transport.MemoryRegistrar); ok {
			if err := mr.RegisterMemory(arena.Bytes(), f); err != nil {
				return fmt.Errorf("transceiver: rank %d: register the pool: %w", r.idx, err)
			}
		}
	}
	return nil
}

// sendPair sends q's bytes for one generation rank: straight from the
// blocks to the receipt armed for a direct transfer, else chunk by chunk
// through a send staging buffer, each chunk to the receipt the receiver
// announced for it (descs, in order: the core checked it). ctx is the
// attempt's: it ends when the attempt is given up or the request stops.
func (r *rank) sendPair(q *rankReq, ctx context.Context, p sendPlan, descs <-chan chunkDesc) (int64, int, error) {
	tr := r.transports[p.backend]
	blocks := q.mem[p.first : p.first+p.n]
	packed := p.plan.PackedBytesPerBlock()
	if p.direct != nil {
		if err := tr.Send(ctx, p.direct, segments(blocks, p.plan.SrcSpans())); err != nil {
			return 0, 0, err
		}
		return int64(p.n) * packed, 1, nil
	}
	var sent int64
	chunks := 0
	for lo := 0; lo < p.n; lo += p.chunk {
		hi := min(lo+p.chunk, p.n)
		var d chunkDesc
		select {
		case d = <-descs:
		case <-ctx.Done():
			return sent, chunks, context.Cause(ctx)
		}
		buf, err := r.sendBufs.get(ctx)
		if err != nil {
			return sent, chunks, err
		}
		n := int64(hi-lo) * packed
		if err := p.plan.Pack(buf[:n], blocks[lo:hi]); err != nil {
			r.sendBufs.put(buf)
			return sent, chunks, err
		}
		err = tr.Send(ctx, d.desc, [][]byte{buf[:n]})
		r.sendBufs.put(buf)
		if err != nil {
			return sent, chunks, err
		}
		sent += n
		chunks++
	}
	return sent, chunks, nil
}

// recvPair receives q's bytes from one context rank in chunks, unpacked
// into the blocks.
func (r *rank) recvPair(q *rankReq, e effStartRecv) (int64, int, error) {
	return r.recvChunks(q, r.source(q, e.src), e.to, e.pair)
}

// recvDirect waits for the receipt armed for a direct transfer from s
// (with the request-info) to fill.
func (r *rank) recvDirect(q *rankReq, s *srcIO) error {
	if err := await(q.ctx, s.direct); err != nil {
		s.direct.Cancel() // when ctx ended first; a no-op after Done
		return err
	}
	return nil
}

// await waits for rv to end: its error, or ctx's cause when ctx ends first.
func await(ctx context.Context, rv transport.Recv) error {
	select {
	case <-rv.Done():
		return rv.Err()
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// recvChunks receives the chunks of a staged transfer, keeping up to two in
// flight when the rank has two receive buffers: for each, a receipt into a
// buffer announced to the sender with a chunk descriptor, then, once it is
// in, an unpack into the blocks.
func (r *rank) recvChunks(q *rankReq, s *srcIO, to route, p recvPlan) (int64, int, error) {
	w := chunkWindow{r: r, q: q, s: s, to: to, p: p, depth: min(2, r.recvBufs.count())}
	defer w.cancel()
	total := (p.n + p.chunk - 1) / p.chunk
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

// chunkWindow is the chunks of one receive in flight, oldest first.
type chunkWindow struct {
	r      *rank
	q      *rankReq
	s      *srcIO
	to     route
	p      recvPlan
	depth  int
	next   int // index of the next chunk to announce
	flight []chunkSlot
}

type chunkSlot struct {
	buf    []byte
	rv     transport.Recv
	lo, hi int // blocks
}

// fill announces chunks until depth are in flight, waiting for a buffer
// only when none is.
func (w *chunkWindow) fill(total int) error {
	for w.next < total && len(w.flight) < w.depth {
		var buf []byte
		if len(w.flight) == 0 {
			b, err := w.r.recvBufs.get(w.q.ctx)
			if err != nil {
				return err
			}
			buf = b
		} else if b, ok := w.r.recvBufs.tryGet(); ok {
			buf = b
		} else {
			return nil
		}
		lo, hi := w.next*w.p.chunk, min(w.p.n, (w.next+1)*w.p.chunk)
		rv, err := w.s.tr.Expect([][]byte{buf[:int64(hi-lo)*w.p.plan.PackedBytesPerBlock()]})
		if err != nil {
			w.r.recvBufs.put(buf)
			return err
		}
		w.flight = append(w.flight, chunkSlot{buf: buf, rv: rv, lo: lo, hi: hi})
		if err := w.s.conn.Send(&wire.ChunkDesc{CtxRequestID: w.to.sendID, GenRequestID: w.to.recvID, Index: uint32(w.next), Desc: rv.Descriptor()}); err != nil {
			return err
		}
		w.next++
	}
	return nil
}

// take waits for the oldest chunk and unpacks it into the blocks.
func (w *chunkWindow) take() (int64, error) {
	head := w.flight[0]
	if err := await(w.q.ctx, head.rv); err != nil {
		return 0, err
	}
	size := int64(head.hi-head.lo) * w.p.plan.PackedBytesPerBlock()
	err := w.p.plan.Unpack(w.q.mem[head.lo:head.hi], head.buf[:size])
	w.r.recvBufs.put(head.buf)
	w.flight = w.flight[1:]
	if err != nil {
		return 0, err
	}
	return size, nil
}

// cancel gives back what is still in flight.
func (w *chunkWindow) cancel() {
	for _, sl := range w.flight {
		sl.rv.Cancel()
		w.r.recvBufs.put(sl.buf)
	}
	w.flight = nil
}
