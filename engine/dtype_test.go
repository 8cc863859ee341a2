package engine

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
)

func TestBF16KnownValues(t *testing.T) {
	tests := []struct {
		in   float32
		want uint16
	}{
		{0, 0x0000},
		{float32(math.Copysign(0, -1)), 0x8000},
		{1, 0x3f80},
		{-2, 0xc000},
		{1 + 0x1p-8, 0x3f80},           // halfway between 1 and 1+2⁻⁷: to even (1)
		{1 + 3*0x1p-8, 0x3f82},         // halfway between 1+2⁻⁷ and 1+2⁻⁶: to even
		{1 + 0x1p-8 + 0x1p-20, 0x3f81}, // just above halfway: up
		{math.MaxFloat32, 0x7f80},      // rounds up to +Inf
		{float32(math.Inf(-1)), 0xff80},
		{0x1p-133, 0x0001}, // smallest bf16 subnormal
		{3.140625, 0x4049},
	}
	for _, tc := range tests {
		if got := Float32ToBF16(tc.in); got != tc.want {
			t.Errorf("Float32ToBF16(%g) = %#04x, want %#04x", tc.in, got, tc.want)
		}
	}
	if got := Float32ToBF16(float32(math.NaN())); BF16ToFloat32(got) == BF16ToFloat32(got) {
		t.Errorf("NaN became %#04x, not a NaN", got)
	}
}

func TestFP16KnownValues(t *testing.T) {
	tests := []struct {
		in   float32
		want uint16
	}{
		{0, 0x0000},
		{float32(math.Copysign(0, -1)), 0x8000},
		{1, 0x3c00},
		{-2, 0xc000},
		{0.1, 0x2e66},
		{65504, 0x7bff},                 // largest finite
		{65519, 0x7bff},                 // below the halfway point to 2¹⁶
		{65520, 0x7c00},                 // halfway: to even, which is +Inf
		{1e6, 0x7c00},                   // overflow
		{float32(math.Inf(-1)), 0xfc00}, // -Inf
		{0x1p-14, 0x0400},               // smallest normal
		{0x1p-24, 0x0001},               // smallest subnormal
		{0x1p-25, 0x0000},               // halfway to the smallest subnormal: to even (0)
		{0x1p-25 + 0x1p-35, 0x0001},     // just above: up
		{3 * 0x1p-25, 0x0002},           // halfway between 1 and 2 subnormal quanta: to even (2)
		{1 + 0x1p-11, 0x3c00},           // halfway between 1 and 1+2⁻¹⁰: to even
		{1 + 3*0x1p-11, 0x3c02},
		{-0x1p-14 * (1 - 0x1p-11), 0x8400}, // rounds up from subnormal range into the smallest normal
	}
	for _, tc := range tests {
		if got := Float32ToFP16(tc.in); got != tc.want {
			t.Errorf("Float32ToFP16(%g) = %#04x, want %#04x", tc.in, got, tc.want)
		}
	}
	decodes := map[uint16]float32{0x3c00: 1, 0x7bff: 65504, 0x0001: 0x1p-24, 0x03ff: 0x1p-14 - 0x1p-24, 0xc000: -2}
	for h, want := range decodes {
		if got := FP16ToFloat32(h); got != want {
			t.Errorf("FP16ToFloat32(%#04x) = %g, want %g", h, got, want)
		}
	}
	if !math.IsInf(float64(FP16ToFloat32(0x7c00)), 1) || !math.IsNaN(float64(FP16ToFloat32(0x7e00))) || !math.IsNaN(float64(FP16ToFloat32(Float32ToFP16(float32(math.NaN()))))) {
		t.Error("fp16 Inf/NaN")
	}
}

func TestFP8KnownValues(t *testing.T) {
	tests := []struct {
		in   float32
		want uint8
	}{
		{0, 0x00},
		{float32(math.Copysign(0, -1)), 0x80},
		{1, 0x38},
		{-1, 0xb8},
		{0.1, 0x1d},                   // 1.625×2⁻⁴
		{1.0625, 0x38},                // halfway between 1 and 1.125: to even
		{1.1875, 0x3a},                // halfway between 1.125 and 1.25: to even
		{448, 0x7e},                   // largest finite
		{464, 0x7e},                   // saturates
		{1e9, 0x7e},                   // saturates
		{-1e9, 0xfe},                  // saturates
		{float32(math.Inf(1)), 0x7e},  // saturates
		{float32(math.Inf(-1)), 0xfe}, // saturates
		{0x1p-6, 0x08},                // smallest normal
		{0x1p-9, 0x01},                // smallest subnormal
		{0x1p-10, 0x00},               // halfway to it: to even (0)
		{0x1p-10 + 0x1p-20, 0x01},     // just above: up
		{3 * 0x1p-10, 0x02},           // halfway between 1 and 2 quanta: to even
		{0x1p-6 - 0x1p-11, 0x08},      // rounds up out of the subnormals
		{240, 0x77},                   // 1.875×2⁷
		{float32(math.NaN()), 0x7f},
	}
	for _, tc := range tests {
		if got := Float32ToFP8E4M3(tc.in); got != tc.want {
			t.Errorf("Float32ToFP8E4M3(%g) = %#02x, want %#02x", tc.in, got, tc.want)
		}
	}
	decodes := map[uint8]float32{0x38: 1, 0x7e: 448, 0xfe: -448, 0x01: 0x1p-9, 0x07: 7 * 0x1p-9, 0x08: 0x1p-6, 0x78: 256}
	for b, want := range decodes {
		if got := FP8E4M3ToFloat32(b); got != want {
			t.Errorf("FP8E4M3ToFloat32(%#02x) = %g, want %g", b, got, want)
		}
	}
	if !math.IsNaN(float64(FP8E4M3ToFloat32(0x7f))) || !math.IsNaN(float64(FP8E4M3ToFloat32(0xff))) {
		t.Error("fp8 NaN does not decode to NaN")
	}
}

// TestRoundTripAll: every non-NaN bit pattern of each narrow type decodes to
// a float32 that encodes back to the same pattern.
func TestRoundTripAll(t *testing.T) {
	for b := range 1 << 16 {
		h := uint16(b)
		if f := BF16ToFloat32(h); f == f && Float32ToBF16(f) != h {
			t.Fatalf("bf16 %#04x → %g → %#04x", h, f, Float32ToBF16(f))
		}
		if f := FP16ToFloat32(h); f == f && Float32ToFP16(f) != h {
			t.Fatalf("fp16 %#04x → %g → %#04x", h, f, Float32ToFP16(f))
		}
	}
	for b := range 256 {
		if f := FP8E4M3ToFloat32(uint8(b)); f == f && Float32ToFP8E4M3(f) != uint8(b) {
			t.Fatalf("fp8 %#02x → %g → %#02x", b, f, Float32ToFP8E4M3(f))
		}
	}
}

// nearest is the naive reference: the representable value closest to x
// among vals (sorted, finite, non-negative, with their bit patterns), ties
// to the pattern with an even last bit.
func nearest(x float64, vals []float64, bits []uint32) uint32 {
	i := sort.SearchFloat64s(vals, x)
	if i == len(vals) {
		return bits[len(vals)-1]
	}
	if vals[i] == x || i == 0 {
		return bits[i]
	}
	lo, hi := x-vals[i-1], vals[i]-x
	switch {
	case lo < hi:
		return bits[i-1]
	case hi < lo:
		return bits[i]
	case bits[i]&1 == 0:
		return bits[i]
	}
	return bits[i-1]
}

// TestAgainstNaiveRounding compares fp16 and fp8 rounding with a search for
// the nearest representable value, on values around every binade.
func TestAgainstNaiveRounding(t *testing.T) {
	type format struct {
		name   string
		n      int
		decode func(uint32) float32
		encode func(float32) uint32
		sign   uint32
		limit  float64 // values beyond it overflow (fp16: to Inf)
		over   uint32
	}
	formats := []format{
		{"fp16", 1 << 16, func(b uint32) float32 { return FP16ToFloat32(uint16(b)) }, func(f float32) uint32 { return uint32(Float32ToFP16(f)) }, 0x8000, 65520, 0x7c00},
		{"fp8", 256, func(b uint32) float32 { return FP8E4M3ToFloat32(uint8(b)) }, func(f float32) uint32 { return uint32(Float32ToFP8E4M3(f)) }, 0x80, math.Inf(1), 0x7e},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for _, f := range formats {
		var vals []float64
		var bits []uint32
		for b := range uint32(f.n) {
			v := float64(f.decode(b))
			if b&f.sign == 0 && !math.IsNaN(v) && !math.IsInf(v, 0) {
				vals = append(vals, v)
				bits = append(bits, b)
			}
		}
		for range 20000 {
			// Exponents spanning the format's range and beyond, random
			// mantissas, plus exact midpoints between neighbours.
			x := math.Ldexp(1+r.Float64(), r.IntN(50)-30)
			if r.IntN(4) == 0 {
				i := r.IntN(len(vals) - 1)
				x = (vals[i] + vals[i+1]) / 2
			}
			x = float64(float32(x))
			want := nearest(x, vals, bits)
			if x >= f.limit {
				want = f.over
			}
			if got := f.encode(float32(x)); got != want {
				t.Fatalf("%s(%g) = %#x, nearest is %#x", f.name, x, got, want)
			}
			if got := f.encode(float32(-x)); got != want|f.sign {
				t.Fatalf("%s(%g) = %#x, want %#x", f.name, -x, got, want|f.sign)
			}
		}
	}
}

// TestRows: encodeRow/decodeRow32 round-trip values representable in each
// dtype, little-endian.
func TestRows(t *testing.T) {
	vals := []float64{1, -2, 0.5, 0.1015625, 448, -0x1p-9, 0}
	for _, dt := range []kvcache.DType{kvcache.FP32, kvcache.FP16, kvcache.BF16, kvcache.FP8E4M3} {
		buf := make([]byte, len(vals)*dt.Size())
		encodeRow(dt, buf, vals)
		got := make([]float32, len(vals))
		decodeRow32(dt, got, buf)
		for i := range vals {
			if float64(got[i]) != vals[i] {
				t.Errorf("%v: element %d = %g, want %g", dt, i, got[i], vals[i])
			}
		}
	}
	buf := make([]byte, 4)
	encodeRow(kvcache.BF16, buf, []float64{1, -2})
	if buf[0] != 0x80 || buf[1] != 0x3f || buf[2] != 0x00 || buf[3] != 0xc0 {
		t.Errorf("bf16 row bytes % x, want little-endian 80 3f 00 c0", buf)
	}
	if err := kvDTypeSupported(kvcache.INT8); err == nil {
		t.Error("int8 accepted")
	}
}

// TestDecodeRow32: every bf16 bit pattern, in rows of every length mod 8,
// decodes to BF16ToFloat32's bits with the SIMD kernel and without.
func TestDecodeRow32(t *testing.T) {
	src := make([]byte, 2*65536)
	for h := range 65536 {
		binary.LittleEndian.PutUint16(src[2*h:], uint16(h))
	}
	for _, simd := range []bool{false, haveSIMD} {
		for _, n := range []int{65536, 65535, 8, 7, 1, 17} {
			off := 65536 - n
			dst := make([]float32, n)
			decodeRow32With(simd, kvcache.BF16, dst, src[2*off:])
			for i, v := range dst {
				if want := BF16ToFloat32(uint16(off + i)); math.Float32bits(v) != math.Float32bits(want) {
					t.Fatalf("simd=%v n=%d: element %d (bf16 %#04x) = %#08x, want %#08x", simd, n, i, off+i, math.Float32bits(v), math.Float32bits(want))
				}
			}
		}
	}
}
