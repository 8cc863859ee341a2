package kvcache

import (
	"errors"
	"fmt"
	"strings"
)

// DType is the element type of KV-cache values.
type DType uint8

// The supported element types. The zero value is invalid so that a missing
// dtype is caught by Validate rather than silently meaning fp32.
const (
	DTypeInvalid DType = iota
	FP32
	FP16
	BF16
	FP8E4M3
	INT8
)

var dtypeNames = [...]string{
	DTypeInvalid: "invalid",
	FP32:         "fp32",
	FP16:         "fp16",
	BF16:         "bf16",
	FP8E4M3:      "fp8",
	INT8:         "int8",
}

var dtypeSizes = [...]int{
	FP32:    4,
	FP16:    2,
	BF16:    2,
	FP8E4M3: 1,
	INT8:    1,
}

// DTypes lists every valid dtype in a stable order.
func DTypes() []DType { return []DType{FP32, FP16, BF16, FP8E4M3, INT8} }

// Size returns the size of one element in bytes, or 0 for an invalid dtype.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeSizes[d]
}

// Valid reports whether d is one of the supported dtypes.
func (d DType) Valid() bool { return d > DTypeInvalid && d <= INT8 }

// String returns the lower-case name used in configs and flags ("bf16").
func (d DType) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// ParseDType parses a dtype name, case-insensitively. "fp8_e4m3", "e4m3",
// "float16", "bfloat16" and "float32" are accepted as aliases.
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "fp32", "float32", "float":
		return FP32, nil
	case "fp16", "float16", "half":
		return FP16, nil
	case "bf16", "bfloat16":
		return BF16, nil
	case "fp8", "fp8_e4m3", "e4m3", "float8_e4m3fn":
		return FP8E4M3, nil
	case "int8":
		return INT8, nil
	}
	return DTypeInvalid, fmt.Errorf("kvcache: unknown dtype %q (valid: fp32, fp16, bf16, fp8, int8)", s)
}

// Shape is the model-wide shape of a KV cache, independent of how it is
// sharded over ranks.
type Shape struct {
	// Layers is the number of attention layers in the whole model.
	Layers int
	// KVHeads is the global number of KV heads per layer (1 for MLA).
	KVHeads int
	// HeadDim is the number of elements per head per token (576 for
	// DeepSeek-V3's MLA latent).
	HeadDim int
	// TokensPerBlock is the number of tokens in one paged block.
	TokensPerBlock int
	// KVFactor is 2 when K and V are both cached, 1 when only K is (MLA).
	KVFactor int
	// DType is the element type.
	DType DType
}

// ErrInvalidShape is wrapped by every error Shape.Validate returns.
var ErrInvalidShape = errors.New("kvcache: invalid shape")

// Limits on shape fields. They keep every derived size comfortably inside an
// int64 and reject absurd values that could only come from corrupt input.
const (
	MaxLayers         = 1 << 12
	MaxKVHeads        = 1 << 12
	MaxHeadDim        = 1 << 16
	MaxTokensPerBlock = 1 << 16
)

// Validate reports every field of s that is out of range.
func (s Shape) Validate() error {
	var errs []error
	check := func(name string, v, max int) {
		if v <= 0 || v > max {
			errs = append(errs, fmt.Errorf("%w: %s = %d, want 1..%d", ErrInvalidShape, name, v, max))
		}
	}
	check("layers", s.Layers, MaxLayers)
	check("kv_heads", s.KVHeads, MaxKVHeads)
	check("head_dim", s.HeadDim, MaxHeadDim)
	check("tokens_per_block", s.TokensPerBlock, MaxTokensPerBlock)
	if s.KVFactor != 1 && s.KVFactor != 2 {
		errs = append(errs, fmt.Errorf("%w: kv_factor = %d, want 1 or 2", ErrInvalidShape, s.KVFactor))
	}
	if !s.DType.Valid() {
		errs = append(errs, fmt.Errorf("%w: dtype = %v", ErrInvalidShape, s.DType))
	}
	return errors.Join(errs...)
}

// BytesPerTokenPerLayer is the KV bytes one token occupies in one layer over
// all heads: kv_factor × kv_heads × head_dim × dtype size.
func (s Shape) BytesPerTokenPerLayer() int64 {
	return int64(s.KVFactor) * int64(s.KVHeads) * int64(s.HeadDim) * int64(s.DType.Size())
}

// BytesPerToken is the KV bytes one token occupies across all layers and
// heads of the whole model (Llama-3.1-8B in bf16: 128 KiB).
func (s Shape) BytesPerToken() int64 { return s.BytesPerTokenPerLayer() * int64(s.Layers) }

// BlockLayout is the shape of one block on one rank:
// [Layers, KVFactor, Heads, TokensPerBlock, HeadDim] elements of ElemSize
// bytes, row-major.
type BlockLayout struct {
	Layers         int // layers held by this rank's pipeline stage
	KVFactor       int
	Heads          int // KV heads held by this rank
	TokensPerBlock int
	HeadDim        int
	ElemSize       int // bytes per element
}

// BlockBytes is the size of one block in bytes.
func (b BlockLayout) BlockBytes() int64 {
	return int64(b.Layers) * int64(b.KVFactor) * int64(b.Heads) * int64(b.TokensPerBlock) * int64(b.HeadDim) * int64(b.ElemSize)
}

// RowBytes is the size of one (layer, kv, head, token) row: HeadDim × ElemSize.
func (b BlockLayout) RowBytes() int64 { return int64(b.HeadDim) * int64(b.ElemSize) }

// Offset returns the byte offset inside a block of element 0 of the row
// (layer, kv, head, token). Arguments are indices local to this rank.
func (b BlockLayout) Offset(layer, kv, head, token int) int64 {
	i := ((int64(layer)*int64(b.KVFactor)+int64(kv))*int64(b.Heads)+int64(head))*int64(b.TokensPerBlock) + int64(token)
	return i * b.RowBytes()
}

// Validate reports whether every dimension is positive.
func (b BlockLayout) Validate() error {
	if b.Layers <= 0 || b.KVFactor <= 0 || b.Heads <= 0 || b.TokensPerBlock <= 0 || b.HeadDim <= 0 || b.ElemSize <= 0 {
		return fmt.Errorf("%w: block layout %+v has a non-positive dimension", ErrInvalidShape, b)
	}
	return nil
}
