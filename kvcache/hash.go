package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
)

// Hash identifies the contents of a full block together with everything
// before it: the block's tokens and, through the parent hash, every earlier
// block of the sequence. Two blocks with equal hashes hold the same KV
// values, which is what makes prefix reuse safe.
//
// It is 128 bits of SHA-256: a collision would hand one user's KV cache to
// another user's request, so a short or non-cryptographic hash will not do.
//
// The zero Hash is the root: the parent of a sequence's first block.
type Hash [16]byte

// hashDomain separates block hashes from any other SHA-256 use and versions
// the encoding: change it if what is hashed changes.
const hashDomain = "kvxfer/kvcache/block/v1\x00"

// BlockHash returns the hash of a block holding tokens whose preceding block
// has hash parent (the zero Hash for the first block): the first 16 bytes
// of SHA-256(domain ‖ parent ‖ tokens as little-endian int32).
//
// Callers pass exactly the block's tokens (tokens_per_block of them for a
// full block); only full blocks are ever committed for reuse. The hash does
// not cover model, adapter (LoRA) or dtype: a pool serves one model, and a
// caller that mixes adapters in one pool must fold the adapter into the
// root parent it starts from.
func BlockHash(parent Hash, tokens []int32) Hash {
	var stack [512]byte
	buf := stack[:0]
	if n := hashHeaderLen + 4*len(tokens); n > len(stack) {
		buf = make([]byte, 0, n)
	}
	return blockHash(buf, parent, tokens)
}

// HashBlocks returns the chained hashes of the full blocks of tokens: block
// i covers tokens[i*tokensPerBlock : (i+1)*tokensPerBlock] and its parent is
// the hash of block i-1, or parent for block 0 (the zero Hash to start a
// sequence; the last hash of an earlier call to continue it). A trailing
// partial block has no hash. It panics if tokensPerBlock is not positive.
//
// Hash outside any lock: the result feeds Pool.MatchPrefix and Pool.Commit.
func HashBlocks(parent Hash, tokens []int32, tokensPerBlock int) []Hash {
	if tokensPerBlock <= 0 {
		panic("kvcache: HashBlocks: tokensPerBlock must be positive")
	}
	n := len(tokens) / tokensPerBlock
	if n == 0 {
		return nil
	}
	hs := make([]Hash, n)
	buf := make([]byte, 0, hashHeaderLen+4*tokensPerBlock)
	for i := range hs {
		parent = blockHash(buf, parent, tokens[i*tokensPerBlock:(i+1)*tokensPerBlock])
		hs[i] = parent
	}
	return hs
}

const hashHeaderLen = len(hashDomain) + len(Hash{})

// blockHash encodes the block into buf's storage and hashes it.
func blockHash(buf []byte, parent Hash, tokens []int32) Hash {
	b := append(buf[:0], hashDomain...)
	b = append(b, parent[:]...)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, uint32(t))
	}
	sum := sha256.Sum256(b)
	return Hash(sum[:len(Hash{})])
}

// IsRoot reports whether h is the zero Hash.
func (h Hash) IsRoot() bool { return h == Hash{} }

// String returns h in lower-case hex.
func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// promptDomain separates prompt digests from block hashes.
const promptDomain = "kvxfer/kvcache/prompt/v1\x00"

// PromptDigest returns the digest of a whole prompt's token ids: the first
// 16 bytes of SHA-256(domain ‖ length ‖ tokens as little-endian int32). A
// transfer carries it so that the KV cache of one prompt is never received
// as another's (transceiver.Request.PromptDigest). It is never the zero
// Hash but with probability 2^-128.
func PromptDigest(tokens []int32) Hash {
	h := sha256.New()
	h.Write([]byte(promptDomain))
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(len(tokens)))
	h.Write(b[:])
	buf := make([]byte, 0, 4096)
	for len(tokens) > 0 {
		n := min(len(tokens), cap(buf)/4)
		buf = buf[:0]
		for _, t := range tokens[:n] {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
		}
		h.Write(buf)
		tokens = tokens[n:]
	}
	var d Hash
	copy(d[:], h.Sum(nil))
	return d
}
