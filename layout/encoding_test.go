package layout

import (
	"bytes"
	"encoding"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

var (
	_ encoding.BinaryMarshaler   = CacheState{}
	_ encoding.BinaryAppender    = CacheState{}
	_ encoding.BinaryUnmarshaler = (*CacheState)(nil)
)

// encodingSamples are valid and merely encodable states; they seed the fuzzer.
func encodingSamples() []CacheState {
	dp := state(llama8B, 8, 2)
	dp.Parallel.AttentionDP, dp.Parallel.DPSize, dp.Parallel.DPRank = true, 4, 3
	dp.Parallel.LayersPerPP = []int{20, 12}
	dp.BlockReuse = true
	unsupported := state(llama8B, 2, 1)
	unsupported.Parallel.CP = 2
	big := CacheState{
		Shape:    kvcache.Shape{Layers: kvcache.MaxLayers, KVHeads: kvcache.MaxKVHeads, HeadDim: kvcache.MaxHeadDim, TokensPerBlock: kvcache.MaxTokensPerBlock, KVFactor: 2, DType: kvcache.FP32},
		Parallel: ParallelConfig{TP: MaxTP, PP: 4, CP: 1, LayersPerPP: []int{1, 1, 1, kvcache.MaxLayers - 3}},
	}
	return []CacheState{state(llama8B, 2, 1), mla(4, 2), dp, unsupported, big}
}

func TestEncodingRoundTrip(t *testing.T) {
	for _, s := range encodingSamples() {
		b, err := s.MarshalBinary()
		if err != nil {
			t.Fatalf("MarshalBinary(%v): %v", s, err)
		}
		var got CacheState
		if err := got.UnmarshalBinary(b); err != nil {
			t.Fatalf("UnmarshalBinary(%x): %v", b, err)
		}
		if !got.Equal(s) {
			t.Errorf("round trip changed the state:\n got %v\nwant %v", got, s)
		}
		b2, err := got.AppendBinary([]byte("prefix"))
		if err != nil || !bytes.Equal(b2[6:], b) || string(b2[:6]) != "prefix" {
			t.Errorf("AppendBinary = %x, %v; want prefix + %x", b2, err, b)
		}
	}
}

func TestEncodingBytes(t *testing.T) {
	b, err := state(llama8B, 2, 1).MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	// magic/version, layers 32, kv_heads 8, head_dim 128 (2 bytes), tpb 32,
	// kv_factor 2, bf16, DEFAULT, flags, tp 2, pp 1, cp 1, dp_rank 0,
	// dp_size 0, no layers_per_pp.
	want := []byte{0xC1, 32, 8, 0x80, 0x01, 32, 2, byte(kvcache.BF16), 0, 0, 2, 1, 1, 0, 0, 0}
	if d := cmp.Diff(want, b); d != "" {
		t.Errorf("encoding (-want +got):\n%s", d)
	}
}

func TestMarshalRejectsUnencodable(t *testing.T) {
	tests := []struct {
		name string
		edit func(*CacheState)
		want string
	}{
		{"negative", func(s *CacheState) { s.Shape.Layers = -1 }, "layers: -1 is out of range 1..4096"},
		{"too big", func(s *CacheState) { s.Shape.HeadDim = kvcache.MaxHeadDim + 1 }, "head_dim: 65537 is out of range"},
		{"dtype", func(s *CacheState) { s.Shape.DType = 0 }, "dtype: invalid is not a valid dtype"},
		{"attention", func(s *CacheState) { s.Attention = 2 }, "attention: attention(2) is not DEFAULT or MLA"},
		{"stage", func(s *CacheState) { s.Parallel.LayersPerPP = []int{32, 0} }, "layers_per_pp[1]: 0 is out of range"},
		{"too many stages", func(s *CacheState) { s.Parallel.LayersPerPP = make([]int, MaxPP+1) }, "layers_per_pp length: 1025 is out of range 0..1024"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := state(llama8B, 2, 1)
			tt.edit(&s)
			b, err := s.AppendBinary([]byte{7})
			if err == nil || !strings.HasPrefix(err.Error(), "layout: encode cache state: ") || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v, want one containing %q", err, tt.want)
			}
			if !bytes.Equal(b, []byte{7}) {
				t.Errorf("AppendBinary appended on error: %x", b)
			}
		})
	}
}

func TestUnmarshalRejects(t *testing.T) {
	good, _ := state(llama8B, 2, 1).MarshalBinary() // 16 bytes, see TestEncodingBytes
	// splice replaces n bytes at off with repl.
	splice := func(off, n int, repl ...byte) []byte {
		b := append([]byte(nil), good[:off]...)
		b = append(b, repl...)
		return append(b, good[off+n:]...)
	}
	with := func(off int, repl ...byte) []byte { return splice(off, 1, repl...) }
	tests := []struct {
		name string
		in   []byte
		want string
	}{
		{"empty", nil, "version at offset 0: unexpected end of input"},
		{"magic", with(0, 0x01), "magic at offset 0: first byte 0x01 is not a cache state encoding (want 0xc1)"},
		{"version", with(0, 0xC2), "version at offset 0: unknown version 2 (this build reads version 1)"},
		{"layers zero", with(1, 0), "layers at offset 1: 0 is out of range 1..4096"},
		{"kv heads absurd", with(2, 0xff, 0xff, 0xff, 0xff, 0x0f), "kv_heads at offset 2: 4294967295 is out of range 1..4096"},
		{"head dim not minimal", splice(3, 2, 0x80, 0x81, 0x00), "head_dim at offset 3: uvarint is not minimally encoded"},
		{"overflow", with(5, bytes.Repeat([]byte{0xff}, 11)...), "tokens_per_block at offset 5: uvarint overflows 64 bits"},
		{"kv factor", with(6, 3), "kv_factor at offset 6: 3 is out of range 1..2"},
		{"dtype", with(7, 9), "dtype at offset 7: 9 is not a valid dtype"},
		{"attention", with(8, 2), "attention at offset 8: 2 is not DEFAULT (0) or MLA (1)"},
		{"flags", with(9, 0x84), "flags at offset 9: unknown bits 0x84"},
		{"tp", with(10, 0), "tp at offset 10: 0 is out of range 1..4096"},
		{"pp", with(11, 0x81, 0x08), "pp at offset 11: 1025 is out of range 1..1024"},
		{"cp", with(12, 0), "cp at offset 12: 0 is out of range 1..1024"},
		{"dp rank", with(13, 0x80, 0x20), "dp_rank at offset 13: 4096 is out of range 0..4095"},
		{"dp size", with(14, 0x81, 0x20), "dp_size at offset 14: 4097 is out of range 0..4096"},
		{"stages absurd", with(15, 0xff, 0x7f), "layers_per_pp length at offset 15: 16383 is out of range 0..1024"},
		{"stages cannot fit the rest", with(15, 0x80, 0x08), "layers_per_pp length at offset 15: 1024 entries cannot fit in the 0 bytes left"},
		{"stage value", with(15, 2, 32, 0), "layers_per_pp at offset 17: 0 is out of range 1..4096"},
		{"stages cannot fit", with(15, 2, 32), "layers_per_pp length at offset 15: 2 entries cannot fit in the 1 bytes left"},
		{"truncated stage", with(15, 2, 0x80, 0x80), "layers_per_pp at offset 16: unexpected end of input"},
		{"truncated", good[:10], "tp at offset 10: unexpected end of input"},
		{"trailing", append(append([]byte(nil), good...), 0, 0), "trailing data at offset 16: 2 bytes after the end of the state"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := mla(1, 1)
			err := s.UnmarshalBinary(tt.in)
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
			if want := "layout: malformed cache state encoding: " + tt.want; err.Error() != want {
				t.Errorf("err =\n%v\nwant\n%s", err, want)
			}
			if !s.Equal(mla(1, 1)) {
				t.Errorf("UnmarshalBinary changed its receiver on error: %v", s)
			}
		})
	}
}

// FuzzDecodeCacheState checks that the decoder never panics, allocates only
// what the input pays for, and that whatever it accepts re-encodes to the
// same bytes (the encoding is canonical).
func FuzzDecodeCacheState(f *testing.F) {
	for _, s := range encodingSamples() {
		b, err := s.MarshalBinary()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var s CacheState
		if err := s.UnmarshalBinary(in); err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			return
		}
		if n := len(s.Parallel.LayersPerPP); n > len(in) {
			t.Fatalf("decoded %d stages from %d bytes", n, len(in))
		}
		out, err := s.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded state %v does not re-encode: %v", s, err)
		}
		if !bytes.Equal(out, in) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", in, out)
		}
		// Whatever decodes must be safe to validate and to compare.
		_ = s.Validate()
		_ = Compatible(s, s)
	})
}
