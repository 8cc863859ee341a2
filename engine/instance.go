package engine

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// Defaults of InstanceConfig.
const (
	DefaultTokensPerBlock = 32
	DefaultPoolTokens     = 16384
)

// DType is the element type of an instance's KV cache (kvcache's): the
// type of InstanceConfig.DType, named here so that callers that configure
// an engine need not reach below it.
type DType = kvcache.DType

// InstanceConfig says how an Instance is sharded and how large its KV cache
// is.
type InstanceConfig struct {
	TP, PP int // tensor- and pipeline-parallel sizes; 0 means 1
	// LayersPerPP optionally gives the layers of each stage (see
	// layout.ParallelConfig); empty means an even split.
	LayersPerPP []int
	// TokensPerBlock is the paged block size in tokens (default 32).
	TokensPerBlock int
	// DType is the KV-cache element type (default bf16): fp32, fp16, bf16 or
	// fp8 (e4m3).
	DType kvcache.DType
	// PoolTokens is the size of each rank's KV pool in tokens (default
	// 16384); it is rounded up to whole blocks.
	PoolTokens int
	// Allocator provides the pools' memory; nil means the Go heap.
	Allocator kvcache.Allocator
}

// Instance is one model replica sharded over TP×PP ranks inside this
// process. Each rank holds its own shard of the weights (ranges of heads,
// MLP chunks and vocabulary; the weights themselves are shared read-only
// with the Model) and its own kvcache.Pool in exactly the layout
// State().RankLayout(rank) describes, so that a transceiver can move its
// blocks to and from other instances.
//
// The ranks of a stage run one after another and combine their partial
// results with an all-reduce whose summation order is fixed by the model,
// not by the layout; stages run in sequence (see doc.go).
//
// An Instance is not safe for concurrent use, except for State, Pools,
// Model and FreeBlocks: the pools are, and a transceiver may use them while
// the instance computes.
type Instance struct {
	model  *Model
	cfg    Config
	state  layout.CacheState
	pools  []*kvcache.Pool
	ranks  []*rankShard
	stages [][]*rankShard // [pp][tp]
	dt     kvcache.DType
	tpb    int

	closed bool
	// Scratch reused between forward passes.
	x, h, hf []float64
	rope     ropeTable
}

// rankShard is one rank: which part of the model it holds and its pool.
type rankShard struct {
	idx, pp, tp      int
	pool             *kvcache.Pool
	bl               kvcache.BlockLayout
	rowBytes         int
	layerLo, layerHi int // global layers of the stage
	qLo, qHi         int // query heads
	kvLo, kvHi       int // cached heads (global); MLA: 0..1 on every rank
	chunkLo, chunkHi int // MLP chunks
	vocabLo, vocabHi int // LM-head rows (last stage only)

	// part holds the rank's partial sums for the all-reduce in progress:
	// [local group][token][hidden], a group being a query head or an MLP
	// chunk.
	part []float64
	// Scratch.
	q, o, row, qlat, attnLat, k, v, scores, act []float64
}

// NewInstance shards m over cfg.TP×cfg.PP ranks and allocates one pool per
// rank. TP must divide the model's query heads and MLP chunks, and the KV
// heads must be divisible by TP or TP by them (duplicated heads).
func NewInstance(m *Model, cfg InstanceConfig) (*Instance, error) {
	mc := m.cfg
	tp, pp := max(cfg.TP, 1), max(cfg.PP, 1)
	if cfg.TokensPerBlock == 0 {
		cfg.TokensPerBlock = DefaultTokensPerBlock
	}
	if cfg.DType == kvcache.DTypeInvalid {
		cfg.DType = kvcache.BF16
	}
	if cfg.PoolTokens == 0 {
		cfg.PoolTokens = DefaultPoolTokens
	}
	var errs []error
	if err := kvDTypeSupported(cfg.DType); err != nil {
		errs = append(errs, err)
	}
	if mc.QHeads%tp != 0 {
		errs = append(errs, fmt.Errorf("%w: tp %d does not divide the %d query heads of %s", ErrBadConfig, tp, mc.QHeads, mc.Name))
	}
	if mc.MLPChunks%tp != 0 {
		errs = append(errs, fmt.Errorf("%w: tp %d does not divide the %d MLP chunks of %s", ErrBadConfig, tp, mc.MLPChunks, mc.Name))
	}
	if cfg.PoolTokens < 0 {
		errs = append(errs, fmt.Errorf("%w: pool tokens %d", ErrBadConfig, cfg.PoolTokens))
	}
	state := layout.CacheState{
		Shape: kvcache.Shape{Layers: mc.Layers, KVHeads: mc.CacheHeads(), HeadDim: mc.CacheHeadDim(),
			TokensPerBlock: cfg.TokensPerBlock, KVFactor: mc.KVFactor(), DType: cfg.DType},
		Parallel:  layout.ParallelConfig{TP: tp, PP: pp, CP: 1, LayersPerPP: append([]int(nil), cfg.LayersPerPP...)},
		Attention: mc.Attention,
	}
	if err := state.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("%w: %w", ErrBadConfig, err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	nb := kvcache.BlocksForTokens(cfg.PoolTokens, cfg.TokensPerBlock)
	in := &Instance{model: m, cfg: mc, state: state, dt: cfg.DType, tpb: cfg.TokensPerBlock,
		stages: make([][]*rankShard, pp)}
	for r := range state.Parallel.NumRanks() {
		bl := state.RankLayout(r)
		pool, err := kvcache.NewPool(bl, nb, cfg.Allocator)
		if err != nil {
			in.Close()
			return nil, fmt.Errorf("engine: pool of rank %d: %w", r, err)
		}
		ppr, _, tpr := state.Parallel.Coords(r)
		rs := &rankShard{idx: r, pp: ppr, tp: tpr, pool: pool, bl: bl, rowBytes: int(bl.RowBytes())}
		rs.layerLo, rs.layerHi = state.LayerRange(ppr)
		rs.kvLo, rs.kvHi = state.HeadRange(r)
		nq := mc.QHeads / tp
		rs.qLo, rs.qHi = tpr*nq, (tpr+1)*nq
		nc := mc.MLPChunks / tp
		rs.chunkLo, rs.chunkHi = tpr*nc, (tpr+1)*nc
		rs.vocabLo, rs.vocabHi = tpr*VocabSize/tp, (tpr+1)*VocabSize/tp
		in.pools = append(in.pools, pool)
		in.ranks = append(in.ranks, rs)
		in.stages[ppr] = append(in.stages[ppr], rs)
	}
	return in, nil
}

// Model returns the model the instance runs.
func (in *Instance) Model() *Model { return in.model }

// State returns the instance's CacheState, for transceiver.Options.
func (in *Instance) State() layout.CacheState {
	s := in.state
	s.Parallel.LayersPerPP = append([]int(nil), s.Parallel.LayersPerPP...)
	return s
}

// Pools returns the pool of every rank, in rank order, for
// transceiver.Options. The instance owns them.
func (in *Instance) Pools() []*kvcache.Pool { return append([]*kvcache.Pool(nil), in.pools...) }

// TokensPerBlock returns the block size in tokens.
func (in *Instance) TokensPerBlock() int { return in.tpb }

// NumBlocks returns the number of blocks of each rank's pool.
func (in *Instance) NumBlocks() int { return in.pools[0].NumBlocks() }

// FreeBlocks returns the number of blocks every rank can still allocate
// (the minimum over the ranks).
func (in *Instance) FreeBlocks() int {
	n := math.MaxInt
	for _, p := range in.pools {
		n = min(n, p.FreeBlocks())
	}
	return n
}

// Close closes every pool. It returns an error (wrapping
// kvcache.ErrBlocksInUse) if blocks were still pinned. Idempotent.
func (in *Instance) Close() error {
	if in.closed {
		return nil
	}
	in.closed = true
	var errs []error
	for r, p := range in.pools {
		if err := p.Close(); err != nil {
			errs = append(errs, fmt.Errorf("engine: rank %d: %w", r, err))
		}
	}
	return errors.Join(errs...)
}

// Sequence is one request's KV cache on an instance: the blocks of every
// rank, in token order, and the number of tokens whose KV they hold. A
// Sequence belongs to the goroutine that uses its instance.
type Sequence struct {
	in     *Instance
	blocks [][]kvcache.BlockID // [rank][block]
	n      int
}

// NewSequence returns an empty sequence that holds no blocks.
func (in *Instance) NewSequence() *Sequence {
	return &Sequence{in: in, blocks: make([][]kvcache.BlockID, len(in.ranks))}
}

// Len returns the number of tokens whose KV is in the cache.
func (s *Sequence) Len() int { return s.n }

// Capacity returns the number of tokens the sequence's blocks can hold.
func (s *Sequence) Capacity() int { return len(s.blocks[0]) * s.in.tpb }

// Reserve grows the sequence's blocks on every rank to hold tokens tokens.
// It is all-or-nothing: on error (wrapping kvcache.ErrPoolExhausted) no
// rank's blocks change.
func (s *Sequence) Reserve(tokens int) error {
	need := kvcache.BlocksForTokens(tokens, s.in.tpb) - len(s.blocks[0])
	if need <= 0 {
		return nil
	}
	for r, p := range s.in.pools {
		ids, err := p.AppendAllocate(s.blocks[r], need)
		if err != nil {
			for u := range r {
				k := len(s.blocks[u]) - need
				s.in.pools[u].Release(s.blocks[u][k:]...)
				s.blocks[u] = s.blocks[u][:k]
			}
			return fmt.Errorf("engine: rank %d: %w", r, err)
		}
		s.blocks[r] = ids
	}
	return nil
}

// Blocks returns, per rank, the blocks that hold the first tokens tokens
// (for a transceiver.Request). The slices alias the sequence.
func (s *Sequence) Blocks(tokens int) [][]kvcache.BlockID {
	nb := kvcache.BlocksForTokens(tokens, s.in.tpb)
	out := make([][]kvcache.BlockID, len(s.blocks))
	for r, b := range s.blocks {
		out[r] = b[:nb:nb]
	}
	return out
}

// SetLen declares that the cache holds n tokens: used after a transfer has
// filled the blocks.
func (s *Sequence) SetLen(n int) error {
	if n < 0 || n > s.Capacity() {
		return fmt.Errorf("engine: sequence length %d, capacity %d", n, s.Capacity())
	}
	s.n = n
	return nil
}

// Release gives every block back to its pool and empties the sequence.
func (s *Sequence) Release() error {
	var errs []error
	for r, b := range s.blocks {
		if len(b) > 0 {
			if err := s.in.pools[r].Release(b...); err != nil {
				errs = append(errs, fmt.Errorf("engine: rank %d: %w", r, err))
			}
		}
		s.blocks[r] = nil
	}
	s.n = 0
	return errors.Join(errs...)
}

// Prefill runs the model over tokens, appending their KV to the sequence,
// zeroes the unused tail of the last block (so that no stale KV of an
// earlier request travels in a transfer), and returns the logits of the last
// token. The sequence must have room (Reserve).
func (in *Instance) Prefill(s *Sequence, tokens []int32) ([]float32, error) {
	return in.prefill(context.Background(), s, tokens)
}

// prefill is Prefill that stops between layers once ctx is done, returning
// ctx's error; the sequence's length is then unchanged (the blocks hold
// partial KV of no use, released with the sequence).
func (in *Instance) prefill(ctx context.Context, s *Sequence, tokens []int32) ([]float32, error) {
	logits, err := in.forward(ctx, s, tokens)
	if err != nil {
		return nil, err
	}
	s.zeroTail()
	return logits, nil
}

// Decode runs the model over one token at the end of the sequence and
// returns the logits of the next.
func (in *Instance) Decode(s *Sequence, token int32) ([]float32, error) {
	return in.forward(context.Background(), s, []int32{token})
}

// DecodeBatch runs one token at the end of each sequence and returns the
// logits of the next token of each.
func (in *Instance) DecodeBatch(seqs []*Sequence, tokens []int32) ([][]float32, error) {
	if len(seqs) != len(tokens) {
		return nil, fmt.Errorf("%w: %d sequences, %d tokens", ErrBadRequest, len(seqs), len(tokens))
	}
	out := make([][]float32, len(seqs))
	for i, s := range seqs {
		lg, err := in.Decode(s, tokens[i])
		if err != nil {
			return nil, err
		}
		out[i] = lg
	}
	return out, nil
}

// zeroTail clears the token slots after Len in the block holding the last
// token, on every rank, layer, kv and head.
func (s *Sequence) zeroTail() {
	tpb := s.in.tpb
	used := s.n % tpb
	if used == 0 {
		return
	}
	for _, r := range s.in.ranks {
		mem := r.pool.Block(s.blocks[r.idx][(s.n-1)/tpb])
		for l := range r.bl.Layers {
			for kv := range r.bl.KVFactor {
				for h := range r.bl.Heads {
					off := int(r.bl.Offset(l, kv, h, used))
					clear(mem[off : off+(tpb-used)*r.rowBytes])
				}
			}
		}
	}
}

// write stores one row (one token of one head) in the cache of rank r.
func (s *Sequence) write(r *rankShard, layer, kv, head, pos int, vals []float64) {
	tpb := s.in.tpb
	mem := r.pool.Block(s.blocks[r.idx][pos/tpb])
	off := int(r.bl.Offset(layer, kv, head, pos%tpb))
	encodeRow(s.in.dt, mem[off:off+r.rowBytes], vals)
}

// gather reads the first n tokens of one head from the cache of rank r into
// dst ([n][HeadDim]).
func (s *Sequence) gather(r *rankShard, layer, kv, head, n int, dst []float64) {
	tpb, d := s.in.tpb, r.bl.HeadDim
	for b := 0; b*tpb < n; b++ {
		cnt := min(tpb, n-b*tpb)
		mem := r.pool.Block(s.blocks[r.idx][b])
		off := int(r.bl.Offset(layer, kv, head, 0))
		decodeRow(s.in.dt, dst[b*tpb*d:(b*tpb+cnt)*d], mem[off:off+cnt*r.rowBytes])
	}
}

// forward runs tokens through every stage, appends their KV and returns the
// logits of the last token.
func (in *Instance) forward(ctx context.Context, s *Sequence, toks []int32) ([]float32, error) {
	if in.closed {
		return nil, ErrClosed
	}
	T := len(toks)
	if T == 0 {
		return nil, fmt.Errorf("%w: no tokens to run", ErrBadRequest)
	}
	n0 := s.n
	if n0+T > s.Capacity() {
		return nil, fmt.Errorf("engine: %d tokens do not fit: the sequence holds %d of %d", T, n0, s.Capacity())
	}
	for _, t := range toks {
		if t < 0 || t >= VocabSize {
			return nil, fmt.Errorf("%w: token %d out of the vocabulary [0,%d)", ErrBadRequest, t, VocabSize)
		}
	}
	m, cfg := in.model, in.cfg
	H := cfg.Hidden
	in.x = grow(in.x, T*H)
	in.h = grow(in.h, T*H)
	x, h := in.x, in.h
	for t, tok := range toks {
		copy(x[t*H:(t+1)*H], m.embed[int(tok)*H:])
	}
	in.rope.fill(m.invFreq, n0, T)
	// Stages run in order; x is the activation one stage hands the next.
	for _, ranks := range in.stages {
		for l := ranks[0].layerLo; l < ranks[0].layerHi; l++ {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			lw := &m.layers[l]
			for t := range T {
				rmsNorm(h[t*H:(t+1)*H], x[t*H:(t+1)*H], lw.attnNorm, cfg.NormEps)
			}
			for _, r := range ranks {
				if cfg.Attention == layout.AttentionMLA {
					r.attentionMLA(in, s, lw, l-r.layerLo, h, T, n0)
				} else {
					r.attentionGQA(in, s, lw, l-r.layerLo, h, T, n0)
				}
			}
			allReduceAdd(ranks, x, T, H)
			for t := range T {
				rmsNorm(h[t*H:(t+1)*H], x[t*H:(t+1)*H], lw.mlpNorm, cfg.NormEps)
			}
			for _, r := range ranks {
				r.mlp(in, lw, h, T)
			}
			allReduceAdd(ranks, x, T, H)
		}
	}
	s.n = n0 + T
	// LM head of the last token, vocabulary-parallel over the last stage.
	in.hf = grow(in.hf, H)
	rmsNorm(in.hf, x[(T-1)*H:T*H], m.finalNorm, cfg.NormEps)
	logits := make([]float32, VocabSize)
	for _, r := range in.stages[len(in.stages)-1] {
		for v := r.vocabLo; v < r.vocabHi; v++ {
			logits[v] = float32(dot(m.lmHead[v*H:(v+1)*H], in.hf) + m.lmBias[v])
		}
	}
	return logits, nil
}

// allReduceAdd sums the partial results of the ranks of a stage and adds
// them to the residual x. The sum runs over the groups (query heads or MLP
// chunks) in their global order, which is rank order and then each rank's
// local order; it starts from zero and is rounded to float32 once, at the
// end. Every layout therefore adds the same float64 numbers in the same
// order, whatever the TP size.
func allReduceAdd(ranks []*rankShard, x []float64, T, H int) {
	for t := range T {
		for i := range H {
			var acc float64
			for _, r := range ranks {
				groups := len(r.part) / (T * H)
				for g := range groups {
					acc += r.part[(g*T+t)*H+i]
				}
			}
			x[t*H+i] = r32(x[t*H+i] + r32(acc))
		}
	}
}

// matRows sets out[t×ostride+j] = float32(w[j] · x[t]) for every row j of w
// ([rows][K]) and token t of x ([T][K]). Rows are the outer loop so that a
// row stays in cache across the tokens of a prefill.
func matRows(out []float64, ostride int, w []float64, rows int, x []float64, T, K int) {
	for j := range rows {
		wr := w[j*K : (j+1)*K]
		for t := range T {
			out[t*ostride+j] = r32(dot(wr, x[t*K:(t+1)*K]))
		}
	}
}

// outProj sets part[t][i] = Σ_d wo[i][d]·o[t][d]: one head's (or chunk's)
// contribution to the all-reduce, not rounded.
func outProj(part, wo, o []float64, T, H, D int) {
	for i := range H {
		wr := wo[i*D : (i+1)*D]
		for t := range T {
			part[t*H+i] = dot(wr, o[t*D:(t+1)*D])
		}
	}
}

func (r *rankShard) attentionGQA(in *Instance, s *Sequence, lw *layerWeights, ll int, h []float64, T, n0 int) {
	cfg := in.cfg
	H, D := cfg.Hidden, cfg.HeadDim
	N := n0 + T
	group := cfg.QHeads / cfg.KVHeads
	scale := 1 / math.Sqrt(float64(D))
	r.part = grow(r.part, (r.qHi-r.qLo)*T*H)
	r.row = grow(r.row, T*D)
	r.k = grow(r.k, N*D)
	r.v = grow(r.v, N*D)
	r.q = grow(r.q, T*D)
	r.o = grow(r.o, T*D)
	r.scores = grow(r.scores, N)
	for kh := r.kvLo; kh < r.kvHi; kh++ {
		local := kh - r.kvLo
		// K and V of the new tokens: computed wholly on this rank, so the
		// bytes cached are the same on every layout.
		matRows(r.row, D, lw.wk[kh*D*H:(kh+1)*D*H], D, h, T, H)
		for t := range T {
			in.rope.rotate(r.row[t*D:(t+1)*D], t)
			s.write(r, ll, 0, local, n0+t, r.row[t*D:(t+1)*D])
		}
		matRows(r.row, D, lw.wv[kh*D*H:(kh+1)*D*H], D, h, T, H)
		for t := range T {
			s.write(r, ll, 1, local, n0+t, r.row[t*D:(t+1)*D])
		}
		// Attention reads K and V back from the cache: the same quantized
		// values a generation instance reads after a transfer.
		s.gather(r, ll, 0, local, N, r.k)
		s.gather(r, ll, 1, local, N, r.v)
		for qh := max(r.qLo, kh*group); qh < min(r.qHi, (kh+1)*group); qh++ {
			matRows(r.q, D, lw.wq[qh*D*H:(qh+1)*D*H], D, h, T, H)
			for t := range T {
				q := r.q[t*D : (t+1)*D]
				in.rope.rotate(q, t)
				sc := r.scores[:n0+t+1]
				for j := range sc {
					sc[j] = dot(q, r.k[j*D:(j+1)*D]) * scale
				}
				softmaxInPlace(sc)
				weightedSum(r.o[t*D:(t+1)*D], sc, r.v, D, 0)
			}
			lq := qh - r.qLo
			outProj(r.part[lq*T*H:(lq+1)*T*H], lw.wo[qh*H*D:(qh+1)*H*D], r.o, T, H, D)
		}
	}
}

func (r *rankShard) attentionMLA(in *Instance, s *Sequence, lw *layerWeights, ll int, h []float64, T, n0 int) {
	cfg := in.cfg
	H, Lat, R, Np, Vd := cfg.Hidden, cfg.KVLatent, cfg.RopeDim, cfg.NopeDim, cfg.VHeadDim
	W := Lat + R
	N := n0 + T
	scale := 1 / math.Sqrt(float64(Np+R))
	r.part = grow(r.part, (r.qHi-r.qLo)*T*H)
	r.row = grow(r.row, T*W)
	r.k = grow(r.k, N*W)
	r.q = grow(r.q, T*(Np+R))
	r.qlat = grow(r.qlat, Lat)
	r.attnLat = grow(r.attnLat, Lat)
	r.o = grow(r.o, T*Vd)
	r.scores = grow(r.scores, N)
	// The latent [c_kv | k_rope] of the new tokens; every TP rank holds
	// (and computes) the whole latent.
	matRows(r.row, W, lw.wdkv, Lat, h, T, H)
	matRows(r.row[Lat:], W, lw.wkr, R, h, T, H)
	for t := range T {
		row := r.row[t*W : (t+1)*W]
		rmsNorm(row[:Lat], row[:Lat], lw.kvNorm, cfg.NormEps)
		in.rope.rotate(row[Lat:], t)
		s.write(r, ll, 0, 0, n0+t, row)
	}
	s.gather(r, ll, 0, 0, N, r.k)
	for qh := r.qLo; qh < r.qHi; qh++ {
		qw := Np + R
		matRows(r.q, qw, lw.wqMLA[qh*qw*H:(qh+1)*qw*H], qw, h, T, H)
		wukT := lw.wukT[qh*Lat*Np : (qh+1)*Lat*Np]
		wuv := lw.wuv[qh*Vd*Lat : (qh+1)*Vd*Lat]
		for t := range T {
			q := r.q[t*qw : (t+1)*qw]
			in.rope.rotate(q[Np:], t)
			// Absorbed key up-projection: q_lat = W_UK(h)ᵀ q_nope, so that
			// scores are taken against the cached latent directly.
			matVec(r.qlat, wukT, q[:Np])
			sc := r.scores[:n0+t+1]
			for j := range sc {
				lat := r.k[j*W : (j+1)*W]
				sc[j] = (dot(r.qlat, lat[:Lat]) + dot(q[Np:], lat[Lat:])) * scale
			}
			softmaxInPlace(sc)
			weightedSum(r.attnLat, sc, r.k, W, 0)
			matVec(r.o[t*Vd:(t+1)*Vd], wuv, r.attnLat) // value up-projection
		}
		lq := qh - r.qLo
		outProj(r.part[lq*T*H:(lq+1)*T*H], lw.wo[qh*H*Vd:(qh+1)*H*Vd], r.o, T, H, Vd)
	}
}

func (r *rankShard) mlp(in *Instance, lw *layerWeights, h []float64, T int) {
	cfg := in.cfg
	H := cfg.Hidden
	cs := cfg.FFN / cfg.MLPChunks
	nc := r.chunkHi - r.chunkLo
	r.part = grow(r.part, nc*T*H)
	r.act = grow(r.act, 2*T*cs)
	gate, up := r.act[:T*cs], r.act[T*cs:]
	for c := r.chunkLo; c < r.chunkHi; c++ {
		matRows(gate, cs, lw.wg[c*cs*H:(c+1)*cs*H], cs, h, T, H)
		matRows(up, cs, lw.wu[c*cs*H:(c+1)*cs*H], cs, h, T, H)
		for i, g := range gate {
			gate[i] = r32(silu(g) * up[i])
		}
		lc := c - r.chunkLo
		outProj(r.part[lc*T*H:(lc+1)*T*H], lw.wd[c*H*cs:(c+1)*H*cs], gate, T, H, cs)
	}
}
