package transceiver

import (
	"context"
	"fmt"
	"os"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver/internal/mover"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// Where the driver meets the data mover (internal/mover): one send or
// receive of a pair of ranks, as the core planned it (sendPlan, recvPlan),
// over the pair's backend, on one of the rank's workers.

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
	for _, n := range r.names {
		if mr, ok := r.transports[n].(transport.MemoryRegistrar); ok {
			if err := mr.RegisterMemory(arena.Bytes(), f); err != nil {
				return fmt.Errorf("transceiver: rank %d: register the pool: %w", r.idx, err)
			}
		}
	}
	return nil
}

// sendPair sends q's bytes for one generation rank: straight to the
// receipt armed for a direct transfer, else staged, each chunk to the
// receipt announced for it (descs, in the order the core checked). ctx is
// the attempt's: it ends when the attempt is given up or the request
// stops.
func (r *rank) sendPair(ctx context.Context, q *rankReq, p sendPlan, descs <-chan mover.Chunk) (int64, int, error) {
	pair := mover.Pair{Transport: r.transports[p.backend], Blocks: q.mem[p.first : p.first+p.n], Plan: p.plan, Chunk: p.chunk, Buffers: r.sendBufs}
	if p.direct == nil {
		return pair.SendStaged(ctx, descs)
	}
	n, err := pair.SendDirect(ctx, p.direct)
	if err != nil {
		return 0, 0, err
	}
	return n, 1, nil
}

// recvPair receives q's bytes from one context rank in chunks, unpacked
// into the blocks, announcing each chunk's receipt on the pair's control
// connection.
func (r *rank) recvPair(q *rankReq, e effStartRecv) (int64, int, error) {
	s := r.source(q, e.src)
	pair := mover.Pair{Transport: s.tr, Blocks: q.mem[:e.pair.n], Plan: e.pair.plan, Chunk: e.pair.chunk, Buffers: r.recvBufs}
	return pair.ReceiveStaged(q.ctx, func(c mover.Chunk) error {
		return s.conn.Send(&wire.ChunkDesc{CtxRequestID: e.to.sendID, GenRequestID: e.to.recvID, Index: uint32(c.Index), Desc: c.Desc})
	})
}

// recvDirect waits for the receipt armed for a direct transfer from s
// (with the request-info) to fill.
func (r *rank) recvDirect(q *rankReq, s *srcIO) error {
	if err := mover.Await(q.ctx, s.direct); err != nil {
		s.direct.Cancel() // when ctx ended first; a no-op after Done
		return err
	}
	return nil
}
