package engine

import (
	"encoding/binary"
	"fmt"
	"math"
	"sync"

	"github.com/kvxfer/kvxfer/kvcache"
)

// Converters between float32 and the KV-cache element types. Every
// conversion to a narrower type rounds to nearest, ties to even. fp16 and
// bf16 overflow to ±Inf; fp8 e4m3 (the "fn" variant: no infinities, NaN =
// S.1111.111, largest finite ±448) saturates: finite values and infinities
// beyond ±448 become ±448. NaN stays NaN in every type.

// Float32ToBF16 returns the bfloat16 nearest to f (ties to even).
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep the sign and top payload bits, force quiet
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// BF16ToFloat32 returns the value of a bfloat16 (exact).
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// smallFloat describes a binary floating-point format with subnormals,
// narrower than float32.
type smallFloat struct {
	mbits    int     // stored mantissa bits
	ebits    int     // exponent bits
	bias     int     // exponent bias
	maxBits  uint32  // bit pattern of the largest finite value (no sign)
	max      float64 // largest finite value
	nanBits  uint32  // bit pattern of the canonical NaN (no sign)
	infBits  uint32  // bit pattern of infinity (no sign); unused when saturating
	saturate bool    // out-of-range values become ±max instead of ±Inf
}

var (
	fp16Format = smallFloat{mbits: 10, ebits: 5, bias: 15, maxBits: 0x7bff, max: 65504, nanBits: 0x7e00, infBits: 0x7c00}
	fp8Format  = smallFloat{mbits: 3, ebits: 4, bias: 7, maxBits: 0x7e, max: 448, nanBits: 0x7f, saturate: true}
)

// encode rounds f to the format, ties to even. It works on the exact value
// in float64: scaling by a power of two is exact, so RoundToEven of the
// scaled value is the correctly rounded significand.
func (sf smallFloat) encode(f float32) uint32 {
	x := float64(f)
	var sign uint32
	if math.Signbit(x) {
		sign = 1 << (sf.ebits + sf.mbits)
		x = -x
	}
	switch {
	case math.IsNaN(x):
		return sign | sf.nanBits
	case math.IsInf(x, 0):
		if sf.saturate {
			return sign | sf.maxBits
		}
		return sign | sf.infBits
	case x == 0:
		return sign
	}
	emin := 1 - sf.bias
	_, e := math.Frexp(x) // x = frac × 2^e, frac in [0.5, 1)
	exp := max(e-1, emin)
	quantum := math.Ldexp(1, exp-sf.mbits)
	q := math.RoundToEven(x / quantum)
	if q >= float64(uint64(1)<<(sf.mbits+1)) { // rounded up into the next binade
		q /= 2
		exp++
	}
	if q*math.Ldexp(1, exp-sf.mbits) > sf.max {
		if sf.saturate {
			return sign | sf.maxBits
		}
		return sign | sf.infBits
	}
	if q < float64(uint64(1)<<sf.mbits) { // subnormal: exponent field 0
		return sign | uint32(q)
	}
	return sign | uint32(exp+sf.bias)<<sf.mbits | (uint32(q) - 1<<sf.mbits)
}

// decode returns the exact value of bit pattern b.
func (sf smallFloat) decode(b uint32) float32 {
	signBit := uint32(1) << (sf.ebits + sf.mbits)
	mag := b &^ signBit
	var v float64
	exp := int(mag >> sf.mbits)
	mant := float64(mag & (1<<sf.mbits - 1))
	switch {
	case sf.saturate && mag == sf.nanBits, !sf.saturate && exp == 1<<sf.ebits-1 && mant != 0:
		v = math.NaN()
	case !sf.saturate && exp == 1<<sf.ebits-1:
		v = math.Inf(1)
	case exp == 0:
		v = math.Ldexp(mant, 1-sf.bias-sf.mbits)
	default:
		v = math.Ldexp(mant+float64(uint64(1)<<sf.mbits), exp-sf.bias-sf.mbits)
	}
	if b&signBit != 0 {
		v = -v
	}
	return float32(v)
}

var (
	fp16Table = sync.OnceValue(func() *[1 << 16]float32 {
		var t [1 << 16]float32
		for i := range t {
			t[i] = fp16Format.decode(uint32(i))
		}
		return &t
	})
	fp8Table = sync.OnceValue(func() *[256]float32 {
		var t [256]float32
		for i := range t {
			t[i] = fp8Format.decode(uint32(i))
		}
		return &t
	})
)

// Float32ToFP16 returns the IEEE binary16 nearest to f (ties to even;
// overflow to ±Inf, subnormals kept).
func Float32ToFP16(f float32) uint16 { return uint16(fp16Format.encode(f)) }

// FP16ToFloat32 returns the value of an IEEE binary16 (exact).
func FP16ToFloat32(h uint16) float32 { return fp16Table()[h] }

// Float32ToFP8E4M3 returns the fp8 e4m3fn value nearest to f (ties to
// even), saturating at ±448; NaN becomes 0x7f (with f's sign).
func Float32ToFP8E4M3(f float32) uint8 { return uint8(fp8Format.encode(f)) }

// FP8E4M3ToFloat32 returns the value of an fp8 e4m3fn byte (exact).
func FP8E4M3ToFloat32(b uint8) float32 { return fp8Table()[b] }

// kvDTypeSupported reports whether the model can keep its KV cache in dt.
// int8 needs scales the reference model does not have.
func kvDTypeSupported(dt kvcache.DType) error {
	switch dt {
	case kvcache.FP32, kvcache.FP16, kvcache.BF16, kvcache.FP8E4M3:
		return nil
	}
	return fmt.Errorf("%w: KV-cache dtype %v is not supported by the reference model (fp32, fp16, bf16, fp8)", ErrBadConfig, dt)
}

// encodeRow stores src (values already rounded to float32) into dst in
// dtype dt, little-endian. dst must hold len(src) elements.
func encodeRow(dt kvcache.DType, dst []byte, src []float64) {
	switch dt {
	case kvcache.FP32:
		for i, v := range src {
			binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(float32(v)))
		}
	case kvcache.BF16:
		for i, v := range src {
			binary.LittleEndian.PutUint16(dst[2*i:], Float32ToBF16(float32(v)))
		}
	case kvcache.FP16:
		for i, v := range src {
			binary.LittleEndian.PutUint16(dst[2*i:], Float32ToFP16(float32(v)))
		}
	case kvcache.FP8E4M3:
		dst = dst[:len(src)]
		for i, v := range src {
			dst[i] = Float32ToFP8E4M3(float32(v))
		}
	default:
		panic(fmt.Sprintf("engine: encode %v", dt))
	}
}

// decodeRow32 reads len(dst) elements of dtype dt from src (every dtype's
// values are float32 values). bf16 rows convert eight at a time with AVX2 where there is no
// race detector to see the loads (TestDecodeRow32 checks both ways).
func decodeRow32(dt kvcache.DType, dst []float32, src []byte) {
	decodeRow32With(haveSIMD && !raceEnabled, dt, dst, src)
}

func decodeRow32With(simd bool, dt kvcache.DType, dst []float32, src []byte) {
	if simd && dt == kvcache.BF16 && len(dst) >= 8 {
		n := len(dst) &^ 7
		_ = src[2*n-1]
		bf16ToF32(&dst[0], &src[0], n)
		dst, src = dst[n:], src[2*n:]
	}
	switch dt {
	case kvcache.FP32:
		src = src[:4*len(dst)]
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case kvcache.BF16:
		src = src[:2*len(dst)]
		for i := range dst {
			dst[i] = BF16ToFloat32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case kvcache.FP16:
		t := fp16Table()
		src = src[:2*len(dst)]
		for i := range dst {
			dst[i] = t[binary.LittleEndian.Uint16(src[2*i:])]
		}
	case kvcache.FP8E4M3:
		t := fp8Table()
		src = src[:len(dst)]
		for i := range dst {
			dst[i] = t[src[i]]
		}
	default:
		panic(fmt.Sprintf("engine: decode %v", dt))
	}
}
