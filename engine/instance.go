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
	x, h, hf, acc, lg []float64
	pos               []int
	rope              ropeTable
	segs              []segment
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
	// Scratch of the batch's projections.
	q, kv, o, act []float64
	// Scratch of the attention of each worker goroutine.
	ws []attnScratch
}

// attnScratch is one worker's scratch for the attention of one sequence.
type attnScratch struct {
	k, v                 []float32 // the cached K and V (GQA) or latents (MLA)
	v64                  []float64 // the cached V widened (GQA, SIMD)
	scores, qlat, attLat []float64
	acc                  []float64 // weighted sums of a block of queries
}

// segment is one sequence's run of rows in a batch.
type segment struct {
	s    *Sequence
	n0   int // tokens in the cache before the batch
	row0 int // first row of the batch
	T    int // rows (new tokens)
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
// The blocks go back last first, so that cached ones are evicted tail
// first, before the blocks their prefix needs.
func (s *Sequence) Release() error {
	var errs []error
	for r, b := range s.blocks {
		if len(b) > 0 {
			if err := s.in.pools[r].Release(reversed(b)...); err != nil {
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

// prefill is Prefill that stops once ctx is done (checked between layers
// and at least every 256 queries of the attention), returning
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

// DecodeBatch runs one token at the end of each sequence (tokens[i] after
// seqs[i]) in one pass over the weights, and returns the logits of the
// next token of each. The results are those of Decode on each sequence
// alone, bit for bit: every row of the batch is computed by the same
// dot products in the same order. The sequences must be distinct and have
// room for one more token; on error none of them changes.
func (in *Instance) DecodeBatch(seqs []*Sequence, tokens []int32) ([][]float32, error) {
	if len(seqs) != len(tokens) {
		return nil, fmt.Errorf("%w: decode batch of %d sequences and %d tokens", ErrBadRequest, len(seqs), len(tokens))
	}
	segs := in.segs[:0]
	for i, s := range seqs {
		segs = append(segs, segment{s: s, row0: i, T: 1})
	}
	in.segs = segs
	defer clear(segs) // hold no sequence after the call
	return in.forwardBatch(context.Background(), segs, tokens)
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
func (s *Sequence) gather(r *rankShard, layer, kv, head, n int, dst []float32) {
	tpb, d := s.in.tpb, r.bl.HeadDim
	for b := 0; b*tpb < n; b++ {
		cnt := min(tpb, n-b*tpb)
		mem := r.pool.Block(s.blocks[r.idx][b])
		off := int(r.bl.Offset(layer, kv, head, 0))
		decodeRow32(s.in.dt, dst[b*tpb*d:(b*tpb+cnt)*d], mem[off:off+cnt*r.rowBytes])
	}
}

// forward runs tokens at the end of one sequence and returns the logits of
// the last token.
func (in *Instance) forward(ctx context.Context, s *Sequence, toks []int32) ([]float32, error) {
	segs := append(in.segs[:0], segment{s: s, T: len(toks)})
	in.segs = segs
	defer clear(segs)
	lg, err := in.forwardBatch(ctx, segs, toks)
	if err != nil {
		return nil, err
	}
	return lg[0], nil
}

// forwardBatch runs a batch through every stage: the rows of segs (each a
// run of toks at the end of its sequence, in order) go through every
// projection together, one pass over the weights, and each segment's rows
// attend to their own sequence. It appends their KV and returns the logits
// of each segment's last token. A row's results do not depend on the
// other rows of the batch.
func (in *Instance) forwardBatch(ctx context.Context, segs []segment, toks []int32) ([][]float32, error) {
	if err := in.checkBatch(segs, toks); err != nil {
		return nil, err
	}
	in.embed(segs, toks)
	if err := in.layers(ctx, segs, len(toks)); err != nil {
		return nil, err
	}
	for _, sg := range segs {
		sg.s.n = sg.n0 + sg.T
	}
	return in.logits(segs), nil
}

// checkBatch checks that segs cut toks into runs of distinct sequences of
// this instance, in order, that fit, and that every token is in the
// vocabulary; it sets each segment's first position (n0).
func (in *Instance) checkBatch(segs []segment, toks []int32) error {
	if in.closed {
		return ErrClosed
	}
	T := len(toks)
	if T == 0 || len(segs) == 0 {
		return fmt.Errorf("%w: no tokens to run", ErrBadRequest)
	}
	row := 0
	for i := range segs {
		sg := &segs[i]
		s := sg.s
		switch {
		case s == nil || s.in != in:
			return fmt.Errorf("%w: sequence %d of the batch is not of this instance", ErrBadRequest, i)
		case sg.T <= 0 || sg.row0 != row:
			return fmt.Errorf("%w: sequence %d of the batch has rows %d..%d, want from %d", ErrBadRequest, i, sg.row0, sg.row0+sg.T, row)
		case s.n+sg.T > s.Capacity():
			return fmt.Errorf("engine: %d tokens do not fit: the sequence holds %d of %d", sg.T, s.n, s.Capacity())
		}
		for _, o := range segs[:i] {
			if o.s == s {
				return fmt.Errorf("%w: sequence %d of the batch appears twice", ErrBadRequest, i)
			}
		}
		sg.n0 = s.n
		row += sg.T
	}
	if row != T {
		return fmt.Errorf("%w: the batch's sequences have %d rows, %d tokens given", ErrBadRequest, row, T)
	}
	for _, t := range toks {
		if t < 0 || t >= VocabSize {
			return fmt.Errorf("%w: token %d out of the vocabulary [0,%d)", ErrBadRequest, t, VocabSize)
		}
	}
	return nil
}

// embed sets the batch's activations (in.x) to the tokens' embeddings and
// the rotary tables to the rows' positions.
func (in *Instance) embed(segs []segment, toks []int32) {
	m, H := in.model, in.cfg.Hidden
	T := len(toks)
	in.x = grow(in.x, T*H)
	in.h = grow(in.h, T*H)
	for t, tok := range toks {
		for i, w := range m.embed[int(tok)*H : (int(tok)+1)*H] {
			in.x[t*H+i] = float64(w)
		}
	}
	in.pos = grow(in.pos, T)
	for _, sg := range segs {
		for t := range sg.T {
			in.pos[sg.row0+t] = sg.n0 + t
		}
	}
	in.rope.fill(m.invFreq, in.pos)
}

// layers runs the T rows of the batch through every layer of every stage,
// in order (x is the activation one stage hands the next), appending each
// row's KV; it stops when ctx ends.
func (in *Instance) layers(ctx context.Context, segs []segment, T int) error {
	m, cfg := in.model, in.cfg
	H := cfg.Hidden
	x, h := in.x, in.h
	for _, ranks := range in.stages {
		for l := ranks[0].layerLo; l < ranks[0].layerHi; l++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			lw := &m.layers[l]
			normRows(h, x, lw.attnNorm, cfg.NormEps, T, H)
			for _, r := range ranks {
				if cfg.Attention == layout.AttentionMLA {
					r.attentionMLA(ctx, in, segs, lw, l-r.layerLo, h, T)
				} else {
					r.attentionGQA(ctx, in, segs, lw, l-r.layerLo, h, T)
				}
			}
			// A long prompt's attention stops part-way once ctx is done.
			if err := ctx.Err(); err != nil {
				return err
			}
			in.allReduceAdd(ranks, T)
			normRows(h, x, lw.mlpNorm, cfg.NormEps, T, H)
			for _, r := range ranks {
				r.mlp(in, lw, h, T)
			}
			in.allReduceAdd(ranks, T)
		}
	}
	return nil
}

// logits returns the logits of each segment's last token: the LM head,
// vocabulary-parallel over the last stage.
func (in *Instance) logits(segs []segment) [][]float32 {
	m, cfg := in.model, in.cfg
	H := cfg.Hidden
	S := len(segs)
	in.hf = grow(in.hf, S*H)
	for i, sg := range segs {
		last := sg.row0 + sg.T - 1
		rmsNorm(in.hf[i*H:(i+1)*H], in.x[last*H:(last+1)*H], m.finalNorm, cfg.NormEps)
	}
	in.lg = grow(in.lg, S*VocabSize)
	for _, r := range in.stages[len(in.stages)-1] {
		gemmPar(in.lg[r.vocabLo:], VocabSize, m.lmHead[r.vocabLo*H:r.vocabHi*H], r.vocabHi-r.vocabLo, H, in.hf, H, S, false)
	}
	out := make([][]float32, S)
	flat := make([]float32, S*VocabSize)
	for i := range out {
		lg := flat[i*VocabSize : (i+1)*VocabSize : (i+1)*VocabSize]
		for v := range lg {
			lg[v] = float32(in.lg[i*VocabSize+v] + m.lmBias[v])
		}
		out[i] = lg
	}
	return out
}

// allReduceAdd sums the partial results of the ranks of a stage and adds
// them to the residual x. The sum runs over the groups (query heads or MLP
// chunks) in their global order, which is rank order and then each rank's
// local order; it starts from zero and is rounded to float32 once, at the
// end. Every layout therefore adds the same float64 numbers in the same
// order, whatever the TP size.
// Large batches are split over cores by tokens.
func (in *Instance) allReduceAdd(ranks []*rankShard, T int) {
	H := in.cfg.Hidden
	in.acc = grow(in.acc, T*H)
	groups := 0
	for _, r := range ranks {
		groups += len(r.part) / (T * H)
	}
	rowChunks(T, H*groups, func(lo, hi int) {
		acc := in.acc[lo*H : hi*H]
		clear(acc)
		for _, r := range ranks {
			for g := range len(r.part) / (T * H) {
				for i, v := range r.part[g*T*H+lo*H : g*T*H+hi*H] {
					acc[i] += v
				}
			}
		}
		x := in.x[lo*H : hi*H]
		for i, v := range acc {
			x[i] = r32(x[i] + r32(v))
		}
	})
}

// normRows sets h[t] = rmsNorm(x[t]) for the T rows of width H, split over
// cores by tokens when there are many.
func normRows(h, x, w []float64, eps float64, T, H int) {
	rowChunks(T, 8*H, func(lo, hi int) {
		for t := lo; t < hi; t++ {
			rmsNorm(h[t*H:(t+1)*H], x[t*H:(t+1)*H], w, eps)
		}
	})
}

// rowChunks runs fn over [0,T) in chunks of 64 rows, split over cores when
// T rows of perRow operations are enough work.
func rowChunks(T, perRow int, fn func(lo, hi int)) {
	const chunk = 64
	parallel(workers(T*perRow), (T+chunk-1)/chunk, func(_, i int) {
		fn(i*chunk, min(T, (i+1)*chunk))
	})
}

// outProj sets part[g][t][i] = dot32(w_g[i], a[t×as+g×D:][:D]) for the
// groups g < ng (query heads or MLP chunks), where w_g = w[g×H×D:] is the
// group's [H][D] output projection: each group's contribution to the
// all-reduce, not rounded. The groups are split over cores.
func outProj(part []float64, w []float32, ng, H, D int, a []float64, as, T int) {
	parallel(workers(ng*H*D*T), ng, func(_, g int) {
		gemm(part[g*T*H:(g+1)*T*H], H, w[g*H*D:(g+1)*H*D], H, D, a[g*D:], as, T, false)
	})
}

// scratch returns worker scratch for nw workers.
func (r *rankShard) scratch(nw int) []attnScratch {
	if len(r.ws) < nw {
		r.ws = append(r.ws, make([]attnScratch, nw-len(r.ws))...)
	}
	return r.ws
}

func (r *rankShard) attentionGQA(ctx context.Context, in *Instance, segs []segment, lw *layerWeights, ll int, h []float64, T int) {
	cfg := in.cfg
	H, D := cfg.Hidden, cfg.HeadDim
	group := cfg.QHeads / cfg.KVHeads
	scale := 1 / math.Sqrt(float64(D))
	nkv, nq := r.kvHi-r.kvLo, r.qHi-r.qLo
	kw, qw := nkv*D, nq*D
	// Q, K and V of the new tokens: computed wholly on this rank, so the
	// bytes cached are the same on every layout.
	r.kv = grow(r.kv, 2*T*kw)
	kn, vn := r.kv[:T*kw], r.kv[T*kw:]
	r.q = grow(r.q, T*qw)
	gemmPar(kn, kw, lw.wk[r.kvLo*D*H:r.kvHi*D*H], kw, H, h, H, T, true)
	gemmPar(vn, kw, lw.wv[r.kvLo*D*H:r.kvHi*D*H], kw, H, h, H, T, true)
	gemmPar(r.q, qw, lw.wq[r.qLo*D*H:r.qHi*D*H], qw, H, h, H, T, true)
	for t := range T {
		for hh := range nkv {
			in.rope.rotate(kn[t*kw+hh*D:t*kw+(hh+1)*D], t)
		}
		for hh := range nq {
			in.rope.rotate(r.q[t*qw+hh*D:t*qw+(hh+1)*D], t)
		}
	}
	for _, sg := range segs {
		for t := range sg.T {
			row := sg.row0 + t
			for hh := range nkv {
				sg.s.write(r, ll, 0, hh, sg.n0+t, kn[row*kw+hh*D:row*kw+(hh+1)*D])
				sg.s.write(r, ll, 1, hh, sg.n0+t, vn[row*kw+hh*D:row*kw+(hh+1)*D])
			}
		}
	}
	// Attention reads K and V back from the cache: the same quantized
	// values a generation instance reads after a transfer. One task per
	// sequence and KV head, split over cores.
	r.o = grow(r.o, T*qw)
	work := 0
	for _, sg := range segs {
		work += sg.T * (sg.n0 + sg.T) * 2 * D * nq
	}
	nw := workers(work)
	ws := r.scratch(nw)
	parallel(nw, len(segs)*nkv, func(w, i int) {
		sg, hh := segs[i/nkv], i%nkv
		kh := r.kvLo + hh
		sc := &ws[w]
		N := sg.n0 + sg.T
		sc.k = grow(sc.k, (N+4)*D)
		sc.v = grow(sc.v, N*D)
		sg.s.gather(r, ll, 0, hh, N, sc.k)
		clear(sc.k[N*D:])
		sg.s.gather(r, ll, 1, hh, N, sc.v)
		if haveSIMD {
			sc.v64 = grow(sc.v64, N*D)
			for i, x := range sc.v {
				sc.v64[i] = float64(x)
			}
		}
		for qh := max(r.qLo, kh*group); qh < min(r.qHi, (kh+1)*group); qh++ {
			lq := qh - r.qLo
			off := sg.row0*qw + lq*D
			sc.attend(ctx, r.o[off:], r.q[off:], qw, sg.n0, sg.T, D, scale)
		}
	})
	r.part = grow(r.part, nq*T*H)
	outProj(r.part, lw.wo[r.qLo*H*D:r.qHi*H*D], nq, H, D, r.o, qw, T)
}

// attendBlock is the number of queries whose scores are computed together.
const attendBlock = 8

// attend computes one head's attention of the T query rows q[t×qs:][:D]
// (positions n0..n0+T-1) over the keys and values of positions 0..n0+t in
// sc.k and sc.v (and, with the SIMD kernels, sc.v64), into o[t×qs:][:D].
// The scores of attendBlock queries are computed together, against the
// keys the last one sees (sc.k has zero rows up to a multiple of four
// beyond them); each score is the same dot product whatever it is computed
// with, and each query's softmax takes only its own keys. With the SIMD
// kernels the block's weighted sums go through the values in tiles of
// attendTile positions, every query's sum continuing in order of position
// from one tile to the next, so that each tile is read from cache once per
// block; each output is the sum weightedSum gives. It returns early,
// leaving o partly computed, once ctx is done.
func (sc *attnScratch) attend(ctx context.Context, o, q []float64, qs, n0, T, D int, scale float64) {
	sc.attendWith(haveSIMD, ctx, o, q, qs, n0, T, D, scale)
}

// attendTile is the number of value rows a block's weighted sums take
// from cache at a time.
const attendTile = 128

func (sc *attnScratch) attendWith(simd bool, ctx context.Context, o, q []float64, qs, n0, T, D int, scale float64) {
	sc.scores = grow(sc.scores, attendBlock*(n0+T+4))
	tiled := simd && D%32 == 0
	if tiled {
		sc.acc = grow(sc.acc, attendBlock*D)
		_ = sc.v64[(n0+T)*D-1]
	}
	for t0 := 0; t0 < T; t0 += attendBlock {
		if t0%256 == 256-attendBlock && ctx.Err() != nil {
			return
		}
		nb := min(attendBlock, T-t0)
		nk := n0 + t0 + nb
		stride := (nk + 3) &^ 3
		gemm(sc.scores, stride, sc.k[:stride*D], stride, D, q[t0*qs:], qs, nb, false)
		for u := range nb {
			t := t0 + u
			row := sc.scores[u*stride : u*stride+n0+t+1]
			softmax(row, scale)
			if !tiled {
				weightedSum(o[t*qs:t*qs+D], row, sc.v, D, 0)
			}
		}
		if !tiled {
			continue
		}
		acc := sc.acc[:nb*D]
		clear(acc)
		for j0 := 0; j0 < nk; j0 += attendTile {
			for u := range nb {
				j1 := min(j0+attendTile, n0+t0+u+1)
				for d := 0; d < D && j1 > j0; d += 32 {
					wsum64(&acc[u*D+d], &sc.scores[u*stride+j0], j1-j0, &sc.v64[j0*D+d], D)
				}
			}
		}
		for u := range nb {
			t := t0 + u
			for d, v := range acc[u*D : (u+1)*D] {
				o[t*qs+d] = r32(v)
			}
		}
	}
}

func (r *rankShard) attentionMLA(ctx context.Context, in *Instance, segs []segment, lw *layerWeights, ll int, h []float64, T int) {
	cfg := in.cfg
	H, Lat, R, Np, Vd := cfg.Hidden, cfg.KVLatent, cfg.RopeDim, cfg.NopeDim, cfg.VHeadDim
	W, qw := Lat+R, Np+R
	scale := 1 / math.Sqrt(float64(Np+R))
	nq := r.qHi - r.qLo
	// The latent [c_kv | k_rope] of the new tokens; every TP rank holds
	// (and computes) the whole latent.
	r.kv = grow(r.kv, T*W)
	gemmPar(r.kv, W, lw.wdkv, Lat, H, h, H, T, true)
	gemmPar(r.kv[Lat:], W, lw.wkr, R, H, h, H, T, true)
	for t := range T {
		row := r.kv[t*W : (t+1)*W]
		rmsNorm(row[:Lat], row[:Lat], lw.kvNorm, cfg.NormEps)
		in.rope.rotate(row[Lat:], t)
	}
	for _, sg := range segs {
		for t := range sg.T {
			row := sg.row0 + t
			sg.s.write(r, ll, 0, 0, sg.n0+t, r.kv[row*W:(row+1)*W])
		}
	}
	r.q = grow(r.q, T*nq*qw)
	gemmPar(r.q, nq*qw, lw.wqMLA[r.qLo*qw*H:r.qHi*qw*H], nq*qw, H, h, H, T, true)
	for t := range T {
		for hh := range nq {
			in.rope.rotate(r.q[t*nq*qw+hh*qw+Np:t*nq*qw+(hh+1)*qw], t)
		}
	}
	r.o = grow(r.o, T*nq*Vd)
	work := 0
	for _, sg := range segs {
		work += sg.T * (sg.n0 + sg.T) * (2*W + Lat) * nq
	}
	nw := workers(work)
	ws := r.scratch(nw)
	parallel(nw, len(segs)*nq, func(w, i int) {
		sg, lq := segs[i/nq], i%nq
		qh := r.qLo + lq
		sc := &ws[w]
		N := sg.n0 + sg.T
		sc.k = grow(sc.k, N*W)
		sg.s.gather(r, ll, 0, 0, N, sc.k)
		sc.qlat = grow(sc.qlat, Lat)
		sc.attLat = grow(sc.attLat, Lat)
		sc.scores = grow(sc.scores, N)
		wukT := lw.wukT[qh*Lat*Np : (qh+1)*Lat*Np]
		wuv := lw.wuv[qh*Vd*Lat : (qh+1)*Vd*Lat]
		for t := range sg.T {
			if t%64 == 63 && ctx.Err() != nil {
				return
			}
			row := sg.row0 + t
			q := r.q[row*nq*qw+lq*qw : row*nq*qw+(lq+1)*qw]
			// Absorbed key up-projection: q_lat = W_UK(h)ᵀ q_nope, so that
			// scores are taken against the cached latent directly.
			gemm(sc.qlat, Lat, wukT, Lat, Np, q[:Np], Np, 1, true)
			s := sc.scores[:sg.n0+t+1]
			for j := range s {
				lat := sc.k[j*W : (j+1)*W]
				s[j] = dot32(lat[:Lat], sc.qlat) + dot32(lat[Lat:], q[Np:])
			}
			softmax(s, scale)
			weightedSum(sc.attLat, s, sc.k, W, 0)
			// Value up-projection.
			gemm(r.o[row*nq*Vd+lq*Vd:], Vd, wuv, Vd, Lat, sc.attLat, Lat, 1, true)
		}
	})
	r.part = grow(r.part, nq*T*H)
	outProj(r.part, lw.wo[r.qLo*H*Vd:r.qHi*H*Vd], nq, H, Vd, r.o, nq*Vd, T)
}

func (r *rankShard) mlp(in *Instance, lw *layerWeights, h []float64, T int) {
	cfg := in.cfg
	H := cfg.Hidden
	cs := cfg.FFN / cfg.MLPChunks
	nc := r.chunkHi - r.chunkLo
	fw := nc * cs
	r.act = grow(r.act, 3*T*fw)
	gate, up, e := r.act[:T*fw], r.act[T*fw:2*T*fw], r.act[2*T*fw:]
	gemmPar(gate, fw, lw.wg[r.chunkLo*cs*H:r.chunkHi*cs*H], fw, H, h, H, T, true)
	gemmPar(up, fw, lw.wu[r.chunkLo*cs*H:r.chunkHi*cs*H], fw, H, h, H, T, true)
	siluMul(gate, up, e)
	r.part = grow(r.part, nc*T*H)
	outProj(r.part, lw.wd[r.chunkLo*H*cs:r.chunkHi*H*cs], nc, H, cs, gate, fw, T)
}
