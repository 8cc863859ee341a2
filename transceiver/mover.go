package transceiver

import (
	"context"
	"net"

	"github.com/kvxfer/kvxfer/transport"

	"github.com/kvxfer/kvxfer/transceiver/internal/mover"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
)

// Where the driver meets the data mover (internal/mover): one send or
// receive of a pair of ranks, as the core planned it (sendPlan, recvPlan),
// over the pair's backend, on one of the rank's workers.

// sendPair sends q's bytes for one generation rank as e planned them:
// straight to the receipt armed for a direct transfer, else staged, each
// chunk to the receipt announced for it (descs, in the order the core
// checked); then the Ready that follows the data when e says so. ctx is
// the attempt's: it ends when the attempt is given up or the request
// stops.
func (r *rank) sendPair(ctx context.Context, q *rankReq, e effStartSend, descs <-chan mover.Chunk) (mover.Moved, event) {
	p := e.pair
	tr := r.transports[p.backend]
	pair := mover.Pair{Transport: tr, Blocks: q.mem[p.first : p.first+p.n], Plan: p.plan, Chunk: p.chunk, Buffers: r.sendBufs, Check: r.descCheck(tr, e.to),
		Gather: gatherOK(p.plan, p.chunk), Owner: q}
	m := pair.Send(ctx, p.direct, descs)
	if m.Err == nil && e.readyAfter {
		r.send(e.to, effReady{gen: e.gen, to: e.to, chunk: p.chunk}.frame())
	}
	return m, evSent{gen: e.gen, attempt: e.attempt, err: m.Err}
}

// descCheck returns the check of the descriptors a generation rank hands
// this rank over the control connection of to, for a backend that connects
// where a descriptor says (transport.Dialer; nil for the others): the host
// must be one this rank may send that peer's data to (peerPolicy.dataCheck).
func (r *rank) descCheck(tr transport.Transport, to route) func(transport.Descriptor) error {
	d, ok := tr.(transport.Dialer)
	if !ok {
		return nil
	}
	var peer string
	if cc := r.ctrl.Conn(uint64(to.conn)); cc != nil {
		peer, _, _ = net.SplitHostPort(cc.Peer().Endpoint)
	}
	return func(desc transport.Descriptor) error {
		host, err := d.DescriptorHost(desc)
		if err != nil {
			return err
		}
		return r.set.peers.dataCheck(host, peer)
	}
}

// recvPair receives q's bytes from one context rank in chunks, unpacked
// into the blocks, announcing each chunk's receipt on the pair's control
// connection.
func (r *rank) recvPair(q *rankReq, e effStartRecv) (mover.Moved, event) {
	s := q.srcs[e.src]
	pair := mover.Pair{Transport: s.tr, Blocks: q.mem[:e.pair.n], Plan: e.pair.plan, Chunk: e.pair.chunk, Buffers: r.recvBufs, Owner: q,
		Scatter: scatterOK(e.pair.plan, e.pair.chunk)}
	m := pair.Receive(q.ctx, func(c mover.Chunk) error {
		return s.conn.Send(&wire.ChunkDesc{CtxRequestID: e.to.sendID, GenRequestID: e.to.recvID, Index: uint32(c.Index), Desc: c.Desc})
	})
	return m, evReceived{src: e.src, err: m.Err}
}

// recvDirect waits for the receipt armed for a direct transfer from e's
// source (with the request-info) to fill.
func (r *rank) recvDirect(q *rankReq, e effRequestInfo) (mover.Moved, event) {
	s := q.srcs[e.src]
	m := mover.Pair{Transport: s.tr, Blocks: q.mem, Plan: e.plan}.AwaitDirect(q.ctx, s.direct)
	return m, evReceived{src: e.src, err: m.Err}
}
