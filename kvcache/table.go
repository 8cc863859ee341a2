package kvcache

import "slices"

// BlocksForTokens returns the number of blocks that hold numTokens tokens,
// tokensPerBlock to a block: the last block may be partly filled. It panics
// if tokensPerBlock is not positive and returns 0 for numTokens <= 0.
func BlocksForTokens(numTokens, tokensPerBlock int) int {
	if tokensPerBlock <= 0 {
		panic("kvcache: BlocksForTokens: tokensPerBlock must be positive")
	}
	if numTokens <= 0 {
		return 0
	}
	return (numTokens-1)/tokensPerBlock + 1
}

// BlockTable is the ordered list of the blocks of one request on one rank:
// block i holds the request's tokens [i×TokensPerBlock, (i+1)×TokensPerBlock).
// It is what a transfer moves ("the request's blocks, in order", or with
// reuse "the last N blocks"). The table holds one reference to each block
// it lists, and gives them back in Release.
//
// The zero BlockTable is empty and ready to use. A BlockTable is not safe
// for concurrent use; the pool it draws from is.
type BlockTable struct {
	ids []BlockID
}

// Len returns the number of blocks in the table.
func (t *BlockTable) Len() int { return len(t.ids) }

// IDs returns the blocks in order. The slice aliases the table: the caller
// must not modify it, and it is valid until the table next changes.
func (t *BlockTable) IDs() []BlockID { return t.ids }

// Last returns the last n blocks in order (all of them if the table is
// shorter), aliasing the table like IDs: the blocks a receiver must fill
// when it already holds the first Len()-n from its own prefix cache.
func (t *BlockTable) Last(n int) []BlockID {
	n = max(0, min(n, len(t.ids)))
	return t.ids[len(t.ids)-n:]
}

// Append adds blocks at the end of the table, which takes over one
// reference to each: blocks from Pool.Allocate or Pool.MatchPrefix, or
// blocks the caller has Retained for the table.
func (t *BlockTable) Append(ids ...BlockID) { t.ids = append(t.ids, ids...) }

// Grow allocates from p enough blocks at the end of the table to hold
// numTokens tokens in all, and returns how many it added (0 if the table
// is already large enough). Like Pool.Allocate it is all-or-nothing: on
// error (ErrPoolExhausted) the table is unchanged.
func (t *BlockTable) Grow(p *Pool, numTokens int) (int, error) {
	need := BlocksForTokens(numTokens, p.Layout().TokensPerBlock) - len(t.ids)
	if need <= 0 {
		return 0, nil
	}
	ids, err := p.AppendAllocate(t.ids, need)
	if err != nil {
		return 0, err
	}
	t.ids = ids
	return need, nil
}

// Release gives the table's references back to p, last block first, so
// that among blocks that become cached the tail of the prefix is evicted
// before the blocks it depends on, and empties the table. On error (a block
// already released behind the table's back) nothing is released and the
// table is unchanged.
func (t *BlockTable) Release(p *Pool) error {
	if len(t.ids) == 0 {
		return nil
	}
	slices.Reverse(t.ids)
	if err := p.Release(t.ids...); err != nil {
		slices.Reverse(t.ids)
		return err
	}
	clear(t.ids)
	t.ids = t.ids[:0]
	return nil
}
