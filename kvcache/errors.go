package kvcache

import (
	"errors"
	"strconv"
	"strings"
)

// Sentinel errors returned by Pool. Match them with errors.Is: most are
// returned wrapped, in a *BlockError or with counts appended.
var (
	// ErrPoolExhausted means Allocate found fewer available blocks (free
	// plus evictable cached) than it was asked for. Nothing was allocated.
	// It is the only Pool error that is not a programmer error: callers
	// are expected to wait for blocks to be released and try again.
	ErrPoolExhausted = errors.New("kvcache: pool exhausted")

	// ErrDoubleFree means Release was called for a block whose refcount
	// was already zero (one Release too many, or a Release of a block that
	// was never allocated).
	ErrDoubleFree = errors.New("kvcache: double free")

	// ErrBadBlock means a BlockID is out of range for the pool, or names a
	// block that is not pinned where a pinned block is required (Retain,
	// Commit, Block, BlockOffset).
	ErrBadBlock = errors.New("kvcache: bad block id")

	// ErrCommitted means Commit was asked to index a block under a hash
	// other than the one it is already indexed under.
	ErrCommitted = errors.New("kvcache: block already committed under another hash")

	// ErrClosed is returned by Pool methods called after Close.
	ErrClosed = errors.New("kvcache: pool closed")

	// ErrBlocksInUse is returned (wrapped, with the count) by Pool.Close
	// when blocks were still pinned. The arena is released anyway.
	ErrBlocksInUse = errors.New("kvcache: blocks still in use")
)

// BlockError records a failed Pool operation on one block. Err is or wraps
// one of the sentinels ErrBadBlock, ErrDoubleFree or ErrCommitted.
type BlockError struct {
	Op  string  // "retain", "release", "commit", ...
	ID  BlockID // the offending block
	Err error
}

// Error returns "kvcache: <op> block <id>: <reason>".
func (e *BlockError) Error() string {
	return "kvcache: " + e.Op + " block " + strconv.Itoa(int(e.ID)) + ": " +
		strings.TrimPrefix(e.Err.Error(), "kvcache: ")
}

// Unwrap returns e.Err, so that errors.Is(err, ErrDoubleFree) works.
func (e *BlockError) Unwrap() error { return e.Err }

// misuse returns err, or panics with it in builds with the invariants tag.
// It is used for programmer errors only (bad ids, double frees), never for
// conditions a correct program meets, such as exhaustion or a closed pool.
func misuse(err error) error {
	if invariants {
		panic(err)
	}
	return err
}
