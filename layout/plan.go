package layout

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvxfer/kvxfer/internal/memcopy"
	"github.com/kvxfer/kvxfer/kvcache"
)

var (
	// ErrNotTarget is returned by NewPlan for a pair of ranks that do not
	// exchange KV (neither is in the other's TargetRanks).
	ErrNotTarget = errors.New("layout: ranks are not targets of each other")
	// ErrBufferSize is wrapped by Pack and Unpack errors about buffer or
	// block lengths.
	ErrBufferSize = errors.New("layout: wrong buffer size")
)

// Run is one contiguous copy inside a block: Len bytes at SrcOff of a
// context block go to DstOff of the matching generation block.
type Run struct {
	SrcOff, DstOff, Len int64
}

// Span is a byte range [Off, Off+Len) of one block.
type Span struct {
	Off, Len int64
}

// Plan says how one block of a context rank maps into the matching block of a
// generation rank (blocks correspond 1:1 by order; both sides have the same
// tokens per block). It is immutable and safe for concurrent use.
//
// The runs are sorted by DstOff and coalesced to maximal runs: two runs merge
// when both their sources and their destinations are adjacent. The bytes a
// context rank contributes to one generation block are packed in the order of
// the generation block, so the receiver's unpacking writes forward. Seen from
// one side only, runs merge further (SrcSpans, DstSpans): Pack and Unpack copy
// per span.
type Plan struct {
	src, dst kvcache.BlockLayout
	srcBytes int64
	dstBytes int64
	packed   int64
	runs     []Run
	// srcSpans and dstSpans are the runs seen from one side only: the
	// packed form is contiguous, so Pack can merge runs whose sources are
	// adjacent even where their destinations are not (and Unpack the
	// reverse). A context rank of TP 2 packing for a generation rank of
	// TP 1 thus copies each block in one piece.
	srcSpans []Span
	dstSpans []Span
}

// NewPlan computes the copy plan from rank prefillRank of the context instance
// (state prefill) to rank genRank of the generation instance (state gen). The
// states must be Compatible (else the *IncompatibleError is returned) and the
// ranks must be targets of each other (else ErrNotTarget).
//
// The plan covers the layers both ranks hold and, within them, every head the
// generation rank holds that this context rank is the one to send. When
// heads are duplicated (on either side, or MLA's replicated latent), a
// generation rank g holding head h gets h from the lowest context TP rank
// that is in g's TargetRanks and holds h; other holders send nothing for h.
// So every byte of every generation block is written exactly once over all
// the context ranks in its TargetRanks, and a plan may be empty
// (PackedBytesPerBlock 0).
func NewPlan(prefill CacheState, prefillRank int, gen CacheState, genRank int) (*Plan, error) {
	if err := Compatible(prefill, gen); err != nil {
		return nil, err
	}
	c, err := prefill.locate("ctx", prefillRank)
	if err != nil {
		return nil, err
	}
	g, err := gen.locate("gen", genRank)
	if err != nil {
		return nil, err
	}
	lo, hi := max(c.lo, g.lo), min(c.hi, g.hi)
	cLo, cHi := tpOverlap(g.local, g.tpPerDP, c.tpPerDP)
	if lo >= hi || c.local < cLo || c.local >= cHi {
		return nil, fmt.Errorf("%w: ctx rank %d (layers [%d,%d), tp %d of %d) and gen rank %d (layers [%d,%d), tp %d of %d)",
			ErrNotTarget, prefillRank, c.lo, c.hi, c.local, c.tpPerDP, genRank, g.lo, g.hi, g.local, g.tpPerDP)
	}
	p := &Plan{src: prefill.rankLayout(prefillRank), dst: gen.rankLayout(genRank)}
	p.srcBytes, p.dstBytes = p.src.BlockBytes(), p.dst.BlockBytes()

	// sends[j]: whether this prefill rank sends the gen rank's local head j.
	heads := prefill.Shape.KVHeads
	sends := make([]bool, g.hhi-g.hlo)
	for j := range sends {
		h := g.hlo + j
		for t := cLo; t < cHi; t++ {
			if tlo, thi := headRange(heads, c.tpPerDP, t); tlo <= h && h < thi {
				sends[j] = t == c.local
				break
			}
		}
	}

	slab := int64(p.dst.TokensPerBlock) * p.dst.RowBytes() // one (layer, kv, head)
	for l := lo; l < hi; l++ {
		for kv := range p.dst.KVFactor {
			for j, ok := range sends {
				if !ok {
					continue
				}
				src := p.src.Offset(l-c.lo, kv, g.hlo+j-c.hlo, 0)
				dst := p.dst.Offset(l-g.lo, kv, j, 0)
				p.add(src, dst, slab)
			}
		}
	}
	for _, r := range p.runs {
		p.packed += r.Len
		p.srcSpans = addSpan(p.srcSpans, r.SrcOff, r.Len)
		p.dstSpans = addSpan(p.dstSpans, r.DstOff, r.Len)
	}
	p.runs = slices.Clip(p.runs)
	return p, nil
}

// add appends a run, merging it into the last one when both sides continue it.
func (p *Plan) add(src, dst, n int64) {
	if k := len(p.runs) - 1; k >= 0 {
		r := &p.runs[k]
		if r.SrcOff+r.Len == src && r.DstOff+r.Len == dst {
			r.Len += n
			return
		}
	}
	p.runs = append(p.runs, Run{SrcOff: src, DstOff: dst, Len: n})
}

// addSpan appends [off, off+n) to spans, merging it into the last span when
// they touch.
func addSpan(spans []Span, off, n int64) []Span {
	if k := len(spans) - 1; k >= 0 && spans[k].Off+spans[k].Len == off {
		spans[k].Len += n
		return spans
	}
	return append(spans, Span{Off: off, Len: n})
}

// Runs returns a copy of the plan's runs, sorted by DstOff. Run i's bytes
// sit in a packed block at the sum of the lengths of runs 0..i-1.
func (p *Plan) Runs() []Run { return slices.Clone(p.runs) }

// SrcSpans returns the byte ranges of a context block that make up its
// packed contribution, in packed order, maximally merged: what a sender
// that gathers straight from pool memory hands to a vectored write.
func (p *Plan) SrcSpans() []Span { return slices.Clone(p.srcSpans) }

// DstSpans returns the byte ranges of a generation block that the packed
// contribution fills, in packed order, maximally merged: what a receiver
// that scatters straight into pool memory hands to a vectored read.
func (p *Plan) DstSpans() []Span { return slices.Clone(p.dstSpans) }

// SrcLayout returns the context rank's block layout.
func (p *Plan) SrcLayout() kvcache.BlockLayout { return p.src }

// DstLayout returns the generation rank's block layout.
func (p *Plan) DstLayout() kvcache.BlockLayout { return p.dst }

// SrcBlockBytes returns the size of one context block.
func (p *Plan) SrcBlockBytes() int64 { return p.srcBytes }

// DstBlockBytes returns the size of one generation block.
func (p *Plan) DstBlockBytes() int64 { return p.dstBytes }

// PackedBytesPerBlock returns the bytes this context rank contributes to each
// block of this generation rank; 0 means it sends nothing.
func (p *Plan) PackedBytesPerBlock() int64 { return p.packed }

// Identity reports whether a context block is byte for byte the generation
// block: one run covering the whole of both, equal block sizes. Then blocks
// can move straight from pool memory to pool memory with no packing.
func (p *Plan) Identity() bool {
	return len(p.runs) == 1 && p.runs[0].SrcOff == 0 && p.runs[0].DstOff == 0 &&
		p.runs[0].Len == p.srcBytes && p.srcBytes == p.dstBytes
}

// Pack copies this context rank's contribution of each block in src (context
// blocks, consecutive in the request's order, each SrcBlockBytes long) into
// dst, which must be exactly len(src)×PackedBytesPerBlock bytes. Any
// sub-range of a request's blocks may be packed on its own: packing blocks
// [i, j) into the bytes [i×P, j×P) of a whole-request buffer gives the same
// bytes as packing all of it. Pack does not allocate; on a length error it
// writes nothing. It writes dst front to back, one copy per source span;
// past memcopy.StreamMin bytes in spans shorter than that, with
// non-temporal stores while it prefetches the next span (see streams), and
// its stores are ordered before it returns.
func (p *Plan) Pack(dst []byte, src [][]byte) error {
	if err := checkPacked("pack: dst", len(dst), len(src), p.packed); err != nil {
		return err
	}
	for i, b := range src {
		if int64(len(b)) != p.srcBytes {
			return fmt.Errorf("%w: pack: src block %d is %d bytes, want %d", ErrBufferSize, i, len(b), p.srcBytes)
		}
	}
	p.pack(dst, src, streams(len(dst), p.srcSpans))
	return nil
}

// pack is Pack on checked buffers, streaming or with copy().
func (p *Plan) pack(dst []byte, src [][]byte, stream bool) {
	off := 0
	if !stream {
		for _, b := range src {
			for _, r := range p.srcSpans {
				s := int(r.Off)
				off += copy(dst[off:off+int(r.Len)], b[s:s+int(r.Len)])
			}
		}
		return
	}
	for i, b := range src {
		for j, r := range p.srcSpans {
			s, n := int(r.Off), int(r.Len)
			memcopy.StreamSpan(dst[off:off+n], b[s:s+n], p.nextSrc(src, i, j))
			off += n
		}
	}
	memcopy.Fence()
}

// nextSrc returns the source bytes pack copies after span j of block i of
// src: span j+1, the first span of block i+1, or nothing.
func (p *Plan) nextSrc(src [][]byte, i, j int) []byte {
	switch {
	case j+1 < len(p.srcSpans):
		r := p.srcSpans[j+1]
		return src[i][r.Off : r.Off+r.Len]
	case i+1 < len(src):
		r := p.srcSpans[0]
		return src[i+1][r.Off : r.Off+r.Len]
	}
	return nil
}

// Unpack is the reverse of Pack: it copies the packed contribution of each
// block from src (exactly len(dst)×PackedBytesPerBlock bytes) into the
// generation blocks dst (each DstBlockBytes long), leaving the bytes other
// context ranks provide untouched. Like Pack it works on any sub-range of
// blocks, does not allocate, writes nothing on a length error, and copies
// with non-temporal stores in the same cases.
func (p *Plan) Unpack(dst [][]byte, src []byte) error {
	if err := checkPacked("unpack: src", len(src), len(dst), p.packed); err != nil {
		return err
	}
	for i, b := range dst {
		if int64(len(b)) != p.dstBytes {
			return fmt.Errorf("%w: unpack: dst block %d is %d bytes, want %d", ErrBufferSize, i, len(b), p.dstBytes)
		}
	}
	p.unpack(dst, src, streams(len(src), p.dstSpans))
	return nil
}

// unpack is Unpack on checked buffers, streaming or with copy().
func (p *Plan) unpack(dst [][]byte, src []byte, stream bool) {
	off := 0
	if !stream {
		for _, b := range dst {
			for _, r := range p.dstSpans {
				d := int(r.Off)
				off += copy(b[d:d+int(r.Len)], src[off:off+int(r.Len)])
			}
		}
		return
	}
	for _, b := range dst {
		for _, r := range p.dstSpans {
			d, n := int(r.Off), int(r.Len)
			memcopy.StreamSpan(b[d:d+n], src[off:off+n], src[off+n:])
			off += n
		}
	}
	memcopy.Fence()
}

// checkPacked checks that a packed buffer of n bytes holds exactly blocks
// blocks of per bytes each, without overflowing.
func checkPacked(what string, n, blocks int, per int64) error {
	if (per == 0 && n == 0) || (per != 0 && int64(n)%per == 0 && int64(n)/per == int64(blocks)) {
		return nil
	}
	return fmt.Errorf("%w: %s is %d bytes, want %d blocks × %d bytes", ErrBufferSize, what, n, blocks, per)
}
