package layout

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvxfer/kvxfer/kvcache"
)

// This file is a naive reference for tests (here and in the transceiver's):
// it is written for obviousness, element by element, not for speed, and must
// not be used on the fast path.

// MaxLogicalBytes bounds the size of a Logical cache, which exists only in
// tests.
const MaxLogicalBytes = 1 << 30

// Logical is the whole KV cache of one request as if unsharded. It is for
// tests, not for the fast path. Data holds elements
// [layer][kv][global head][token][dim] of Shape.DType's size, row-major, for
// Tokens tokens.
type Logical struct {
	Shape  kvcache.Shape
	Tokens int
	Data   []byte
}

// NewLogical returns a zeroed logical cache of tokens tokens. shape must be
// valid and the cache at most MaxLogicalBytes.
func NewLogical(shape kvcache.Shape, tokens int) (*Logical, error) {
	if err := shape.Validate(); err != nil {
		return nil, fmt.Errorf("layout: logical cache: %w", err)
	}
	if tokens < 0 {
		return nil, fmt.Errorf("layout: logical cache: %d tokens", tokens)
	}
	n := shape.BytesPerToken() * int64(tokens)
	if n > MaxLogicalBytes {
		return nil, fmt.Errorf("layout: logical cache: %d bytes exceeds the %d-byte limit of the reference", n, MaxLogicalBytes)
	}
	return &Logical{Shape: shape, Tokens: tokens, Data: make([]byte, n)}, nil
}

// Fill overwrites every byte of l with a pseudo-random stream determined by
// seed alone. The bytes need not be valid numbers of the dtype: transfers
// must be bit-exact whatever they hold.
func (l *Logical) Fill(seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := 0; i < len(l.Data); i += 8 {
		v := r.Uint64()
		for k := 0; k < 8 && i+k < len(l.Data); k++ {
			l.Data[i+k] = byte(v >> (8 * k))
		}
	}
}

// Elem returns the bytes of one element of l (a sub-slice of Data).
func (l *Logical) Elem(layer, kv, head, token, dim int) []byte {
	sh := l.Shape
	i := (((layer*sh.KVFactor+kv)*sh.KVHeads+head)*l.Tokens+token)*sh.HeadDim + dim
	es := sh.DType.Size()
	return l.Data[i*es : (i+1)*es]
}

// NumBlocks returns the number of blocks tokens tokens occupy.
func NumBlocks(tokens, tokensPerBlock int) int { return (tokens + tokensPerBlock - 1) / tokensPerBlock }

// Shard is the naive reference sharding, for tests, not for the fast path
// (it copies one element at a time). It returns the blocks rank holds of l
// under state: NumBlocks(l.Tokens)
// blocks of state.RankLayout(rank), each element copied on its own from the
// logical cache. A rank holding a duplicated head gets a copy of it. Token
// slots past l.Tokens in the last block stay zero. The state's shape must
// equal l.Shape and rank must take part in the request (with attention DP,
// be in DP group DPRank).
func Shard(l *Logical, state CacheState, rank int) ([][]byte, error) {
	if err := state.Validate(); err != nil {
		return nil, err
	}
	if state.Shape != l.Shape {
		return nil, fmt.Errorf("layout: shard: state shape %+v differs from the logical cache's %+v", state.Shape, l.Shape)
	}
	pos, err := state.locate("shard", rank)
	if err != nil {
		return nil, err
	}
	bl := state.rankLayout(rank)
	tpb, es := bl.TokensPerBlock, bl.ElemSize
	blocks := make([][]byte, NumBlocks(l.Tokens, tpb))
	for b := range blocks {
		blocks[b] = make([]byte, bl.BlockBytes())
		for layer := range bl.Layers {
			for kv := range bl.KVFactor {
				for head := range bl.Heads {
					for t := range tpb {
						token := b*tpb + t
						if token >= l.Tokens {
							break
						}
						row := bl.Offset(layer, kv, head, t)
						for d := range bl.HeadDim {
							src := l.Elem(pos.lo+layer, kv, pos.hlo+head, token, d)
							copy(blocks[b][row+int64(d*es):], src)
						}
					}
				}
			}
		}
	}
	return blocks, nil
}
