package layout

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

// docShape is the worked example of the package doc: one (layer, kv, head)
// slab is 2 tokens × 4 dims × 2 bytes = 16 bytes.
var docShape = kvcache.Shape{Layers: 2, KVHeads: 4, HeadDim: 4, TokensPerBlock: 2, KVFactor: 2, DType: kvcache.FP16}

func TestPlanRuns(t *testing.T) {
	s := func(tp, pp int) CacheState { return state(docShape, tp, pp) }
	uneven := s(1, 2)
	uneven.Parallel.LayersPerPP = []int{1, 1}
	tests := []struct {
		name     string
		prefill  CacheState
		c        int
		gen      CacheState
		g        int
		runs     []Run
		identity bool
	}{
		{"doc TP2→TP1 rank 0", s(2, 1), 0, s(1, 1), 0, []Run{{0, 0, 32}, {32, 64, 32}, {64, 128, 32}, {96, 192, 32}}, false},
		{"doc TP2→TP1 rank 1", s(2, 1), 1, s(1, 1), 0, []Run{{0, 32, 32}, {32, 96, 32}, {64, 160, 32}, {96, 224, 32}}, false},
		{"doc TP1→TP2 rank 1", s(1, 1), 0, s(2, 1), 1, []Run{{32, 0, 32}, {96, 32, 32}, {160, 64, 32}, {224, 96, 32}}, false},
		{"identical TP2", s(2, 1), 1, s(2, 1), 1, []Run{{0, 0, 128}}, true},
		{"identical TP1", s(1, 1), 0, s(1, 1), 0, []Run{{0, 0, 256}}, true},
		{"PP1→PP2 takes a whole layer", s(1, 1), 0, s(1, 2), 1, []Run{{128, 0, 128}}, false},
		{"PP2→PP1 gives a whole layer", uneven, 1, s(1, 1), 0, []Run{{0, 128, 128}}, false},
		{"TP2 PP1→TP1 PP2", s(2, 1), 1, s(1, 2), 1, []Run{{64, 32, 32}, {96, 96, 32}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := mustPlan(t, tt.prefill, tt.c, tt.gen, tt.g)
			if d := cmp.Diff(tt.runs, p.Runs()); d != "" {
				t.Errorf("Runs (-want +got):\n%s", d)
			}
			if p.Identity() != tt.identity {
				t.Errorf("Identity = %t, want %t", p.Identity(), tt.identity)
			}
			var sum int64
			for _, r := range tt.runs {
				sum += r.Len
			}
			if p.PackedBytesPerBlock() != sum {
				t.Errorf("PackedBytesPerBlock = %d, want %d", p.PackedBytesPerBlock(), sum)
			}
			if p.SrcBlockBytes() != p.SrcLayout().BlockBytes() || p.DstBlockBytes() != p.DstLayout().BlockBytes() {
				t.Errorf("block sizes disagree with layouts")
			}
		})
	}
}

func TestPlanSpans(t *testing.T) {
	p := mustPlan(t, state(docShape, 2, 1), 0, state(docShape, 1, 1), 0)
	if d := cmp.Diff([]Span{{0, 128}}, p.SrcSpans()); d != "" {
		t.Errorf("SrcSpans (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]Span{{0, 32}, {64, 32}, {128, 32}, {192, 32}}, p.DstSpans()); d != "" {
		t.Errorf("DstSpans (-want +got):\n%s", d)
	}
	p = mustPlan(t, state(docShape, 1, 1), 0, state(docShape, 2, 1), 1)
	if d := cmp.Diff([]Span{{32, 32}, {96, 32}, {160, 32}, {224, 32}}, p.SrcSpans()); d != "" {
		t.Errorf("SrcSpans (-want +got):\n%s", d)
	}
	if d := cmp.Diff([]Span{{0, 128}}, p.DstSpans()); d != "" {
		t.Errorf("DstSpans (-want +got):\n%s", d)
	}
}

func TestPlanRunsIsACopy(t *testing.T) {
	p := mustPlan(t, state(docShape, 1, 1), 0, state(docShape, 1, 1), 0)
	p.Runs()[0].Len = 1
	if !p.Identity() {
		t.Error("modifying Runs() changed the plan")
	}
}

func TestNewPlanErrors(t *testing.T) {
	s := func(tp, pp int) CacheState { return state(docShape, tp, pp) }
	bad := s(2, 1)
	bad.Shape.DType = kvcache.FP32
	tests := []struct {
		name     string
		prefill  CacheState
		c        int
		gen      CacheState
		g        int
		is       error
		contains string
	}{
		{"incompatible", s(2, 1), 0, bad, 0, ErrIncompatible, "dtype: ctx=fp16 gen=fp32"},
		{"not a TP target", s(2, 1), 0, s(2, 1), 1, ErrNotTarget, "ctx rank 0 (layers [0,2), tp 0 of 2) and gen rank 1 (layers [0,2), tp 1 of 2)"},
		{"not a PP target", s(1, 2), 0, s(1, 2), 1, ErrNotTarget, "ctx rank 0 (layers [0,1), tp 0 of 1) and gen rank 1 (layers [1,2)"},
		{"ctx rank out of range", s(2, 1), 2, s(1, 1), 0, nil, "layout: ctx rank 2 out of range [0,2)"},
		{"gen rank out of range", s(2, 1), 0, s(1, 1), 1, nil, "layout: gen rank 1 out of range [0,1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewPlan(tt.prefill, tt.c, tt.gen, tt.g)
			if err == nil || p != nil {
				t.Fatalf("NewPlan = %v, %v; want an error", p, err)
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("err = %v, want %v", err, tt.is)
			}
			if !strings.Contains(err.Error(), tt.contains) {
				t.Errorf("err = %v, want it to contain %q", err, tt.contains)
			}
		})
	}
}

func blocks(n int, size int64, fill byte) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = bytes.Repeat([]byte{fill}, int(size))
	}
	return out
}

func TestPackUnpackLengthErrors(t *testing.T) {
	p := mustPlan(t, state(docShape, 2, 1), 0, state(docShape, 1, 1), 0) // 128 → 256, 128 packed
	src := blocks(3, 128, 1)
	dst := blocks(3, 256, 2)
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"pack short dst", p.Pack(make([]byte, 383), src), "pack: dst is 383 bytes, want 3 blocks × 128 bytes"},
		{"pack long dst", p.Pack(make([]byte, 512), src), "pack: dst is 512 bytes, want 3 blocks × 128 bytes"},
		{"pack short block", p.Pack(make([]byte, 384), [][]byte{src[0], src[1][:127], src[2]}), "pack: src block 1 is 127 bytes, want 128"},
		{"unpack short src", p.Unpack(dst, make([]byte, 100)), "unpack: src is 100 bytes, want 3 blocks × 128 bytes"},
		{"unpack wrong block", p.Unpack([][]byte{dst[0], dst[1], src[2]}, make([]byte, 384)), "unpack: dst block 2 is 128 bytes, want 256"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !errors.Is(tt.err, ErrBufferSize) || !strings.Contains(tt.err.Error(), tt.want) {
				t.Errorf("err = %v, want ErrBufferSize with %q", tt.err, tt.want)
			}
		})
	}
	for i, b := range dst {
		if !bytes.Equal(b, bytes.Repeat([]byte{2}, 256)) {
			t.Errorf("failed Unpack wrote into block %d", i)
		}
	}
	// Zero blocks and an empty plan are fine.
	if err := p.Pack(nil, nil); err != nil {
		t.Errorf("Pack of no blocks: %v", err)
	}
	empty := mustPlan(t, mla(2, 1), 1, mla(1, 1), 0)
	if empty.PackedBytesPerBlock() != 0 || len(empty.Runs()) != 0 || empty.Identity() {
		t.Fatalf("MLA ctx rank 1 → gen TP1 plan is not empty: %v", empty.Runs())
	}
	eb := mla(2, 1).RankLayout(1).BlockBytes()
	if err := empty.Pack(nil, blocks(2, eb, 0)); err != nil {
		t.Errorf("empty Pack: %v", err)
	}
	if err := empty.Unpack(blocks(2, eb, 0), nil); err != nil {
		t.Errorf("empty Unpack: %v", err)
	}
	if err := empty.Pack(make([]byte, 1), blocks(2, eb, 0)); !errors.Is(err, ErrBufferSize) {
		t.Errorf("empty Pack into 1 byte: %v", err)
	}
}

func TestPackUnpackDoNotAllocate(t *testing.T) {
	prefill, gen := state(docShape, 2, 1), state(docShape, 1, 1)
	p := mustPlan(t, prefill, 1, gen, 0)
	src, dst := blocks(4, p.SrcBlockBytes(), 3), blocks(4, p.DstBlockBytes(), 0)
	buf := make([]byte, 4*p.PackedBytesPerBlock())
	if n := testing.AllocsPerRun(100, func() {
		if err := p.Pack(buf, src); err != nil {
			t.Fatal(err)
		}
		if err := p.Unpack(dst, buf); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("Pack+Unpack allocate %v times per run", n)
	}
}
