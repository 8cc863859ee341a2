package layout

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvxfer/kvxfer/kvcache"
)

// The wire encoding of a CacheState, version 1:
//
//	byte     magic/version: 0xC0 | version (0xC1)
//	uvarint  layers, kv_heads, head_dim, tokens_per_block, kv_factor
//	byte     dtype (kvcache.DType), attention (AttentionType)
//	byte     flags: bit 0 attention_dp, bit 1 block_reuse; others zero
//	uvarint  tp, pp, cp, dp_rank, dp_size
//	uvarint  n, the length of layers_per_pp (0 = even split)
//	uvarint  × n: layers_per_pp
//
// Uvarints must be minimal (no redundant 0x80 continuation bytes), so every
// state has exactly one encoding. A Llama-3.1-8B TP2 state takes 16 bytes.
const (
	encMagic   = 0xC0
	encVersion = 1

	flagAttentionDP = 1 << 0
	flagBlockReuse  = 1 << 1
	flagsKnown      = flagAttentionDP | flagBlockReuse
)

// ErrMalformed is wrapped by every error UnmarshalBinary returns.
var ErrMalformed = errors.New("layout: malformed cache state encoding")

// A field's bounds on the wire: each value is checked on its own, so that an
// absurd value is refused where it is read. Relations between fields (the
// heads divide over TP, layers_per_pp sums to layers, cp = 1 ...) are left to
// Validate and Compatible, which can then print both states.
type wireField struct {
	name   string
	lo, hi int
}

var (
	wLayers    = wireField{"layers", 1, kvcache.MaxLayers}
	wKVHeads   = wireField{"kv_heads", 1, kvcache.MaxKVHeads}
	wHeadDim   = wireField{"head_dim", 1, kvcache.MaxHeadDim}
	wTPB       = wireField{"tokens_per_block", 1, kvcache.MaxTokensPerBlock}
	wKVFactor  = wireField{"kv_factor", 1, 2}
	wTP        = wireField{"tp", 1, MaxTP}
	wPP        = wireField{"pp", 1, MaxPP}
	wCP        = wireField{"cp", 1, MaxCP}
	wDPRank    = wireField{"dp_rank", 0, MaxTP - 1}
	wDPSize    = wireField{"dp_size", 0, MaxTP}
	wNumStages = wireField{"layers_per_pp length", 0, MaxPP}
	wStage     = wireField{"layers_per_pp", 1, kvcache.MaxLayers}
)

// AppendBinary appends the encoding of s to b. It fails only when a field is
// outside the bounds the decoder accepts (negative, or beyond the kvcache.Max*
// and layout Max* limits, or an unknown dtype or attention type); s need not
// otherwise be valid, so that an invalid peer state can be passed on and
// reported in full.
func (s CacheState) AppendBinary(b []byte) ([]byte, error) {
	sh, p := s.Shape, s.Parallel
	ints := []struct {
		f wireField
		v int
	}{
		{wLayers, sh.Layers}, {wKVHeads, sh.KVHeads}, {wHeadDim, sh.HeadDim}, {wTPB, sh.TokensPerBlock},
		{wKVFactor, sh.KVFactor}, {wTP, p.TP}, {wPP, p.PP}, {wCP, p.CP}, {wDPRank, p.DPRank},
		{wDPSize, p.DPSize}, {wNumStages, len(p.LayersPerPP)},
	}
	for _, x := range ints {
		if x.v < x.f.lo || x.v > x.f.hi {
			return b, fmt.Errorf("layout: encode cache state: %s: %s", x.f.name, outOfRange(x.v, x.f.lo, x.f.hi))
		}
	}
	for i, n := range p.LayersPerPP {
		if n < wStage.lo || n > wStage.hi {
			return b, fmt.Errorf("layout: encode cache state: %s[%d]: %s", wStage.name, i, outOfRange(n, wStage.lo, wStage.hi))
		}
	}
	if !sh.DType.Valid() {
		return b, fmt.Errorf("layout: encode cache state: dtype: %v is not a valid dtype", sh.DType)
	}
	if !s.Attention.Valid() {
		return b, fmt.Errorf("layout: encode cache state: attention: %v is not DEFAULT or MLA", s.Attention)
	}
	var flags byte
	if p.AttentionDP {
		flags |= flagAttentionDP
	}
	if s.BlockReuse {
		flags |= flagBlockReuse
	}
	b = append(b, encMagic|encVersion)
	for _, v := range []int{sh.Layers, sh.KVHeads, sh.HeadDim, sh.TokensPerBlock, sh.KVFactor} {
		b = binary.AppendUvarint(b, uint64(v))
	}
	b = append(b, byte(sh.DType), byte(s.Attention), flags)
	for _, v := range []int{p.TP, p.PP, p.CP, p.DPRank, p.DPSize, len(p.LayersPerPP)} {
		b = binary.AppendUvarint(b, uint64(v))
	}
	for _, v := range p.LayersPerPP {
		b = binary.AppendUvarint(b, uint64(v))
	}
	return b, nil
}

// MarshalBinary returns the encoding of s; see AppendBinary.
func (s CacheState) MarshalBinary() ([]byte, error) { return s.AppendBinary(make([]byte, 0, 32)) }

// UnmarshalBinary decodes data, which must be exactly one encoded state,
// into s. Every field is checked against its bounds as it is read, and the
// error (wrapping ErrMalformed) names the field and its byte offset. It does
// not check relations between fields: call Validate or Compatible. On error s
// is left unchanged. Decoding allocates only the LayersPerPP slice, whose
// length is checked against MaxPP and the bytes left before it is allocated.
func (s *CacheState) UnmarshalBinary(data []byte) error {
	d := decoder{b: data}
	var out CacheState
	d.header()
	sh := &out.Shape
	sh.Layers = d.uvarint(wLayers)
	sh.KVHeads = d.uvarint(wKVHeads)
	sh.HeadDim = d.uvarint(wHeadDim)
	sh.TokensPerBlock = d.uvarint(wTPB)
	sh.KVFactor = d.uvarint(wKVFactor)
	if v, at := d.byte("dtype"); d.err == nil && !kvcache.DType(v).Valid() {
		d.fail("dtype", at, fmt.Sprintf("%d is not a valid dtype", v))
	} else {
		sh.DType = kvcache.DType(v)
	}
	if v, at := d.byte("attention"); d.err == nil && !AttentionType(v).Valid() {
		d.fail("attention", at, fmt.Sprintf("%d is not DEFAULT (0) or MLA (1)", v))
	} else {
		out.Attention = AttentionType(v)
	}
	flags, at := d.byte("flags")
	if d.err == nil && flags&^flagsKnown != 0 {
		d.fail("flags", at, fmt.Sprintf("unknown bits 0x%02x", flags&^flagsKnown))
	}
	out.Parallel.AttentionDP = flags&flagAttentionDP != 0
	out.BlockReuse = flags&flagBlockReuse != 0
	p := &out.Parallel
	p.TP = d.uvarint(wTP)
	p.PP = d.uvarint(wPP)
	p.CP = d.uvarint(wCP)
	p.DPRank = d.uvarint(wDPRank)
	p.DPSize = d.uvarint(wDPSize)
	nAt := d.off
	n := d.uvarint(wNumStages)
	if d.err == nil && n > len(d.b)-d.off {
		d.fail(wNumStages.name, nAt, fmt.Sprintf("%d entries cannot fit in the %d bytes left", n, len(d.b)-d.off))
	}
	if d.err == nil && n > 0 {
		p.LayersPerPP = make([]int, n)
		for i := range p.LayersPerPP {
			p.LayersPerPP[i] = d.uvarint(wStage)
		}
	}
	if d.err == nil && d.off != len(d.b) {
		d.fail("trailing data", d.off, fmt.Sprintf("%d bytes after the end of the state", len(d.b)-d.off))
	}
	if d.err != nil {
		return d.err
	}
	*s = out
	return nil
}

// decoder reads fields in order and keeps the first error; after an error
// every read returns zero.
type decoder struct {
	b   []byte
	off int
	err error
}

func (d *decoder) fail(field string, at int, why string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s at offset %d: %s", ErrMalformed, field, at, why)
	}
}

func (d *decoder) header() {
	v, at := d.byte("version")
	if d.err != nil {
		return
	}
	if v&0xF0 != encMagic {
		d.fail("magic", at, fmt.Sprintf("first byte 0x%02x is not a cache state encoding (want 0x%02x)", v, encMagic|encVersion))
	} else if v&0x0F != encVersion {
		d.fail("version", at, fmt.Sprintf("unknown version %d (this build reads version %d)", v&0x0F, encVersion))
	}
}

func (d *decoder) byte(field string) (byte, int) {
	at := d.off
	if d.err != nil {
		return 0, at
	}
	if d.off >= len(d.b) {
		d.fail(field, at, "unexpected end of input")
		return 0, at
	}
	d.off++
	return d.b[at], at
}

func (d *decoder) uvarint(f wireField) int {
	at := d.off
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b[d.off:])
	switch {
	case n == 0:
		d.fail(f.name, at, "unexpected end of input")
		return 0
	case n < 0:
		d.fail(f.name, at, "uvarint overflows 64 bits")
		return 0
	case n > 1 && d.b[d.off+n-1] == 0:
		d.fail(f.name, at, "uvarint is not minimally encoded")
		return 0
	case v < uint64(f.lo) || v > uint64(f.hi):
		d.fail(f.name, at, fmt.Sprintf("%d is out of range %d..%d", v, f.lo, f.hi))
		return 0
	}
	d.off += n
	return int(v)
}
