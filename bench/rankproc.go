package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
)

// A process of --process-per-rank hosts one rank of the context or the
// generation instance (setup.Ranks) and joins the instance's other
// processes in a transceiver.CoordinatedGroup (an instance of one rank
// needs none). The process hosting rank 0 of an instance of several
// listens first and tells the parent where (op listening); the parent
// then starts the others with that address. Then, by role:
//
//	context:    prepare {id, tokens, seed} → prepared {opaque}: the rank's
//	            share of the request, filled and handed over
//	generation: receive {id, tokens, seed, opaque} → receiving: the pull
//	            starts into the rank's blocks
//	            collect → collected {results}: waits for every pull, checks
//	            the rank's blocks against the reference when asked
//	both:       quit → bye {leaked, failed, agreements}

// rankPeer is a --process-per-rank process.
type rankPeer struct {
	st      layout.CacheState
	ranks   []int
	pools   []*kvcache.Pool
	tr      *transceiver.Transceiver
	ref     bool
	log     *slog.Logger
	gen     bool
	seeds   map[uint64]uint64 // generation: the seed of each request pulling
	failed  int
	agreeNs []int64
}

// rankMain is PeerMain for a --process-per-rank process.
func rankMain(ctx context.Context, sc *bufio.Scanner, enc *json.Encoder, setup peerSetup, env config.Env, log *slog.Logger) error {
	p := &rankPeer{ranks: setup.Ranks, ref: setup.ReferenceFill, log: log, gen: setup.Role == "generation", seeds: map[uint64]uint64{}}
	defer p.close()
	if err := p.start(ctx, setup, env, enc); err != nil {
		enc.Encode(peerMsg{Op: "error", Error: err.Error()})
		return err
	}
	enc.Encode(peerMsg{Op: "ready", Endpoints: p.tr.Endpoints()})
	for sc.Scan() {
		var m peerMsg
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return fmt.Errorf("bench rank: message: %w", err)
		}
		switch m.Op {
		case "prepare":
			opaque, err := prepareRanks(p.tr, p.st, p.ranks, p.pools, m, p.ref)
			reply := peerMsg{Op: "prepared", ID: m.ID, Opaque: opaque}
			if err != nil {
				reply.Error = err.Error()
			}
			enc.Encode(reply)
			p.drainContext(ctx, 0)
		case "receive":
			reply := peerMsg{Op: "receiving", ID: m.ID}
			if err := p.receive(m); err != nil {
				reply.Error = err.Error()
			}
			enc.Encode(reply)
		case "collect":
			res, err := p.collect(ctx, m.Tokens)
			reply := peerMsg{Op: "collected", Results: res}
			if err != nil {
				reply.Error = err.Error()
			}
			enc.Encode(reply)
		case "quit":
			p.drainContext(ctx, -1)
			leaked := 0
			for _, pl := range p.pools {
				leaked += pl.NumBlocks() - pl.FreeBlocks()
			}
			enc.Encode(peerMsg{Op: "bye", Leaked: leaked, Failed: p.failed, Agreements: p.agreeNs})
			return nil
		default:
			return fmt.Errorf("bench rank: unknown op %q", m.Op)
		}
	}
	return sc.Err()
}

// start builds the rank's pool and its transceiver, joined with the
// instance's other processes.
func (p *rankPeer) start(ctx context.Context, setup peerSetup, env config.Env, enc *json.Encoder) error {
	if err := p.st.UnmarshalBinary(setup.State); err != nil {
		return fmt.Errorf("bench rank: setup state: %w", err)
	}
	ct, err := config.NewCacheTransceiver(setup.Backend, p.st.Shape.TokensPerBlock, env)
	if err != nil {
		return err
	}
	if setup.MaxTokensInBuf > 0 {
		ct.MaxTokensInBuffer = setup.MaxTokensInBuf
	}
	for _, r := range p.ranks {
		pl, err := kvcache.NewPool(p.st.RankLayout(r), setup.PoolBlocks, transceiver.PoolAllocator(ct))
		if err != nil {
			return fmt.Errorf("bench rank: pool of rank %d: %w", r, err)
		}
		p.pools = append(p.pools, pl)
	}
	opts := transceiver.Options{State: p.st, Pools: p.pools, Ranks: p.ranks, Logger: p.log}
	if setup.Group.Processes == 1 {
		// The instance is this process: nothing to agree with.
		p.tr, err = transceiver.New(ctx, ct, opts)
		return err
	}
	gc := transceiver.CoordinatedConfig{Processes: setup.Group.Processes, Coordinator: setup.Group.Coordinator}
	if slices.Contains(p.ranks, 0) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("bench rank: coordinator: %w", err)
		}
		gc.Listener = ln
		enc.Encode(peerMsg{Op: "listening", Endpoints: []string{ln.Addr().String()}})
	}
	g, err := transceiver.NewCoordinatedGroup(gc)
	if err != nil {
		if gc.Listener != nil {
			gc.Listener.Close()
		}
		return err
	}
	jctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	opts.Group = g
	p.tr, err = transceiver.New(jctx, ct, opts)
	return err
}

func (p *rankPeer) close() {
	if p.tr != nil {
		p.tr.Close()
	}
	closePools(p.pools)
}

// drainContext collects finished context requests (at least atLeast, see
// CheckContextTransferStatus), keeping what their consensus cost.
func (p *rankPeer) drainContext(ctx context.Context, atLeast int) {
	if p.gen {
		return
	}
	done, _ := p.tr.CheckContextTransferStatus(ctx, atLeast)
	for _, r := range done {
		if r.Err() != nil {
			p.failed++
			p.log.Warn("context transfer failed", "request", r.ID, "err", r.Err())
			continue
		}
		p.agreeNs = append(p.agreeNs, int64(r.Stats().Agreement))
	}
}

// receive starts a pull into this process's ranks.
func (p *rankPeer) receive(m peerMsg) error {
	opaque, err := base64.StdEncoding.DecodeString(m.Opaque)
	if err != nil {
		return err
	}
	nb := layout.NumBlocks(m.Tokens, p.st.Shape.TokensPerBlock)
	blocks := make([][]kvcache.BlockID, len(p.pools))
	for i, pl := range p.pools {
		if blocks[i], err = pl.Allocate(nb); err != nil {
			for j := range i {
				p.pools[j].Release(blocks[j]...)
			}
			return fmt.Errorf("rank %d: %w", p.ranks[i], err)
		}
	}
	req := &transceiver.Request{ID: m.ID, Type: transceiver.GenerationOnly, Blocks: blocks, NumTokens: m.Tokens,
		ContextPhase: &transceiver.ContextPhaseParams{CtxRequestID: m.ID, OpaqueState: opaque}}
	if err := p.tr.RequestAndReceiveAsync(req); err != nil {
		for i, b := range blocks {
			p.pools[i].Release(b...)
		}
		return err
	}
	p.seeds[m.ID] = m.Seed
	return nil
}

// collect waits for every pull in flight, checks the blocks of this
// process's ranks against the reference when asked, and releases them.
func (p *rankPeer) collect(ctx context.Context, tokens int) ([]rankResult, error) {
	done, err := p.tr.CheckGenTransferStatus(ctx, -1)
	if err != nil {
		return nil, err
	}
	out := make([]rankResult, 0, len(done))
	for _, q := range done {
		st := q.Stats()
		res := rankResult{ID: q.ID, Bytes: st.Bytes, DurationNs: int64(st.Duration), AgreementNs: int64(st.Agreement), Backend: st.Backend}
		if q.Err() != nil {
			res.Error = q.Err().Error()
		} else if p.ref {
			if err := p.verify(q.Blocks, tokens, p.seeds[q.ID]); err != nil {
				res.Error = fmt.Sprintf("request %d: %v", q.ID, err)
			}
		}
		delete(p.seeds, q.ID)
		for i, b := range q.Blocks {
			p.pools[i].Release(b...)
		}
		out = append(out, res)
	}
	return out, nil
}

// verify compares this process's ranks' blocks with the reference.
func (p *rankPeer) verify(blocks [][]kvcache.BlockID, tokens int, seed uint64) error {
	l, err := layout.NewLogical(p.st.Shape, tokens)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	l.Fill(seed)
	for i, r := range p.ranks {
		shard, err := layout.Shard(l, p.st, r)
		if err != nil {
			return err
		}
		for j, b := range blocks[i] {
			if !bytes.Equal(p.pools[i].Block(b), shard[j]) {
				return fmt.Errorf("rank %d block %d differs from the reference", r, j)
			}
		}
	}
	return nil
}
