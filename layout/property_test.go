package layout

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
)

// pairing is one context/generation layout pair over one request.
type pairing struct {
	prefill, gen CacheState
	tokens       int
	seed         uint64
}

func (p pairing) String() string {
	return fmt.Sprintf("tokens=%d seed=%d\n ctx: %v\n gen: %v", p.tokens, p.seed, p.prefill, p.gen)
}

// randomSplit splits n layers into parts positive stage sizes.
func randomSplit(r *rand.Rand, n, parts int) []int {
	out := make([]int, parts)
	for i := range out {
		out[i] = 1
	}
	for range n - parts {
		out[r.IntN(parts)]++
	}
	return out
}

// randomSide picks a parallel config (TP × PP ≤ 8) that is valid for shape
// and attention; attention DP with probability dpProb.
func randomSide(r *rand.Rand, sh kvcache.Shape, att AttentionType, dpProb float64) CacheState {
	for {
		tp := []int{1, 2, 3, 4, 6, 8}[r.IntN(6)]
		pp := []int{1, 2, 4}[r.IntN(3)]
		if tp*pp > 8 || pp > sh.Layers {
			continue
		}
		s := CacheState{Shape: sh, Attention: att, Parallel: ParallelConfig{TP: tp, PP: pp, CP: 1}, BlockReuse: r.IntN(2) == 0}
		if r.IntN(2) == 0 {
			s.Parallel.LayersPerPP = randomSplit(r, sh.Layers, pp)
		}
		if r.Float64() < dpProb {
			var sizes []int
			for d := 1; d <= tp; d++ {
				if tp%d == 0 {
					sizes = append(sizes, d)
				}
			}
			s.Parallel.AttentionDP = true
			s.Parallel.DPSize = sizes[r.IntN(len(sizes))]
			s.Parallel.DPRank = r.IntN(s.Parallel.DPSize)
		}
		if s.Validate() == nil {
			return s
		}
	}
}

func randomPairing(r *rand.Rand) pairing {
	att := AttentionDefault
	heads := []int{1, 2, 3, 4, 6, 8, 12}[r.IntN(7)]
	if r.IntN(5) == 0 {
		att, heads = AttentionMLA, 1
	}
	dts := kvcache.DTypes()
	sh := kvcache.Shape{
		Layers:         1 + r.IntN(9),
		KVHeads:        heads,
		HeadDim:        1 + r.IntN(6),
		TokensPerBlock: 1 + r.IntN(4),
		KVFactor:       1 + r.IntN(2),
		DType:          dts[r.IntN(len(dts))],
	}
	return pairing{
		prefill: randomSide(r, sh, att, 0.15),
		gen:     randomSide(r, sh, att, 0.35),
		tokens:  1 + r.IntN(4*sh.TokensPerBlock+3),
		seed:    r.Uint64(),
	}
}

// fixedPairings are the layouts the property test must always cover,
// whatever the random draw: non-power-of-two TP, duplicated heads, MLA,
// uneven PP, attention DP on the generation side.
func fixedPairings() []pairing {
	h12 := kvcache.Shape{Layers: 5, KVHeads: 12, HeadDim: 3, TokensPerBlock: 3, KVFactor: 2, DType: kvcache.BF16}
	h2 := kvcache.Shape{Layers: 4, KVHeads: 2, HeadDim: 2, TokensPerBlock: 2, KVFactor: 2, DType: kvcache.FP32}
	m := kvcache.Shape{Layers: 6, KVHeads: 1, HeadDim: 5, TokensPerBlock: 2, KVFactor: 1, DType: kvcache.FP8E4M3}
	// Requests of a few MiB a rank, past memcopy.StreamMin, so that Pack and
	// Unpack take their non-temporal path (TestFixedPairingsStream); odd row
	// sizes misalign the spans. checkPairing also runs both paths on every
	// pairing, whatever its size.
	big := kvcache.Shape{Layers: 4, KVHeads: 8, HeadDim: 64, TokensPerBlock: 16, KVFactor: 2, DType: kvcache.FP32}
	odd := kvcache.Shape{Layers: 2, KVHeads: 6, HeadDim: 37, TokensPerBlock: 7, KVFactor: 2, DType: kvcache.BF16}
	s := func(sh kvcache.Shape, tp, pp int, split ...int) CacheState {
		c := state(sh, tp, pp)
		c.Parallel.LayersPerPP = split
		if sh.KVHeads == 1 {
			c.Attention = AttentionMLA
		}
		return c
	}
	dp := func(c CacheState, size, rank int) CacheState {
		c.Parallel.AttentionDP, c.Parallel.DPSize, c.Parallel.DPRank = true, size, rank
		return c
	}
	return []pairing{
		{s(h12, 3, 1), s(h12, 2, 1), 7, 1},
		{s(h12, 3, 1), s(h12, 6, 1), 7, 2},
		{s(h12, 2, 2), s(h12, 3, 2, 1, 4), 8, 3},
		{s(h12, 4, 2, 3, 2), s(h12, 6, 1), 5, 4},
		{s(h12, 6, 1), s(h12, 4, 1), 9, 5},
		{s(h2, 2, 1), s(h2, 8, 1), 5, 6},
		{s(h2, 8, 1), s(h2, 4, 2, 3, 1), 5, 7},
		{s(h2, 4, 1), dp(s(h2, 8, 1), 2, 1), 6, 8},
		{s(m, 4, 2), s(m, 2, 2), 5, 9},
		{s(m, 2, 1), s(m, 1, 4, 1, 2, 2, 1), 3, 10},
		{s(m, 8, 1), dp(s(m, 4, 2), 4, 2), 4, 11},
		{s(h12, 2, 1), dp(s(h12, 6, 1), 2, 1), 6, 12},
		{s(big, 1, 1), s(big, 2, 1), 160, 13},
		{s(big, 4, 1), s(big, 1, 2), 160, 14},
		{s(big, 2, 1), s(big, 1, 1), 160, 17},
		{s(odd, 3, 1), s(odd, 2, 1), 700, 15},
		{s(odd, 1, 1), s(odd, 6, 1), 1400, 16},
	}
}

// groupRanks returns the ranks of s that take part in its request.
func groupRanks(s CacheState) []int {
	var out []int
	for r := range s.Parallel.NumRanks() {
		if _, err := s.locate("", r); err == nil {
			out = append(out, r)
		}
	}
	return out
}

// checkPairing moves one request's KV from every context rank to every
// generation rank through Pack and Unpack, in chunks, and checks the result
// against the reference sharding, and that every generation byte is written
// exactly once.
func checkPairing(t *testing.T, p pairing) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("%v\n%s", p, fmt.Sprintf(format, args...))
	}
	l, err := NewLogical(p.prefill.Shape, p.tokens)
	if err != nil {
		fail("%v", err)
	}
	l.Fill(p.seed)
	r := rand.New(rand.NewPCG(p.seed, 1))
	nb := NumBlocks(p.tokens, p.prefill.Shape.TokensPerBlock)

	prefillRanks, genRanks := groupRanks(p.prefill), groupRanks(p.gen)
	got := map[int][][]byte{}   // gen rank → blocks received
	count := map[int][][]byte{} // gen rank → how often each byte was written
	asked := map[int][]int{}    // gen rank → prefill ranks that list it
	for _, g := range genRanks {
		bb := p.gen.RankLayout(g).BlockBytes()
		got[g], count[g] = blocks(nb, bb, 0), blocks(nb, bb, 0)
	}
	for c := range p.prefill.Parallel.NumRanks() {
		targets, err := TargetRanks(p.gen, p.prefill, c)
		if !slices.Contains(prefillRanks, c) {
			if err == nil {
				fail("TargetRanks accepted ctx rank %d outside DP group %d", c, p.prefill.Parallel.DPRank)
			}
			continue
		}
		if err != nil {
			fail("TargetRanks(ctx %d): %v", c, err)
		}
		src, err := Shard(l, p.prefill, c)
		if err != nil {
			fail("Shard(ctx %d): %v", c, err)
		}
		for _, g := range genRanks {
			if !slices.Contains(targets, g) {
				if _, err := NewPlan(p.prefill, c, p.gen, g); !errors.Is(err, ErrNotTarget) {
					fail("NewPlan(ctx %d, gen %d) for non-targets: %v", c, g, err)
				}
			}
		}
		for _, g := range targets {
			asked[g] = append(asked[g], c)
			plan, err := NewPlan(p.prefill, c, p.gen, g)
			if err != nil {
				fail("NewPlan(ctx %d, gen %d): %v", c, g, err)
			}
			pb := int(plan.PackedBytesPerBlock())
			whole := make([]byte, nb*pb)
			if err := plan.Pack(whole, src); err != nil {
				fail("Pack: %v", err)
			}
			// Both copy paths, whichever Pack and Unpack chose for this size.
			for _, stream := range []bool{false, true} {
				alt := bytes.Repeat([]byte{0xa5}, nb*pb)
				plan.pack(alt, src, stream)
				if !bytes.Equal(alt, whole) {
					fail("ctx %d → gen %d: pack(stream %t) differs from Pack", c, g, stream)
				}
			}
			viaCopy, viaStream := blocks(nb, plan.DstBlockBytes(), 0xa5), blocks(nb, plan.DstBlockBytes(), 0xa5)
			plan.unpack(viaCopy, whole, false)
			plan.unpack(viaStream, whole, true)
			if !slices.EqualFunc(viaCopy, viaStream, bytes.Equal) {
				fail("ctx %d → gen %d: unpack with non-temporal stores differs from unpack with copy()", c, g)
			}
			// Chunks of k blocks through a staging buffer of k blocks.
			k := 1 + r.IntN(nb)
			stage := make([]byte, k*pb)
			for i := 0; i < nb; i += k {
				j := min(i+k, nb)
				if err := plan.Pack(stage[:(j-i)*pb], src[i:j]); err != nil {
					fail("Pack chunk [%d,%d): %v", i, j, err)
				}
				if !bytes.Equal(stage[:(j-i)*pb], whole[i*pb:j*pb]) {
					fail("ctx %d → gen %d: chunk [%d,%d) of %d packs differently from the whole", c, g, i, j, k)
				}
				if err := plan.Unpack(got[g][i:j], stage[:(j-i)*pb]); err != nil {
					fail("Unpack chunk [%d,%d): %v", i, j, err)
				}
			}
			// Write count: unpack all-ones into zeroed scratch blocks.
			scratch := blocks(nb, plan.DstBlockBytes(), 0)
			if err := plan.Unpack(scratch, bytes.Repeat([]byte{1}, nb*pb)); err != nil {
				fail("Unpack ones: %v", err)
			}
			for b := range scratch {
				for i, v := range scratch[b] {
					count[g][b][i] += v
				}
			}
		}
	}
	for _, g := range genRanks {
		targets, err := TargetRanks(p.prefill, p.gen, g)
		if err != nil {
			fail("TargetRanks(gen %d): %v", g, err)
		}
		if a, b := slices.Sorted(slices.Values(targets)), slices.Sorted(slices.Values(asked[g])); !slices.Equal(a, b) {
			fail("not symmetric: gen %d targets ctx %v, but ctx ranks %v list gen %d", g, a, b, g)
		}
		want, err := Shard(l, p.gen, g)
		if err != nil {
			fail("Shard(gen %d): %v", g, err)
		}
		for b := range want {
			if i := slices.IndexFunc(count[g][b], func(v byte) bool { return v != 1 }); i >= 0 {
				fail("gen %d block %d byte %d written %d times", g, b, i, count[g][b][i])
			}
			if !bytes.Equal(want[b], got[g][b]) {
				fail("gen %d block %d differs from the reference sharding", g, b)
			}
		}
	}
}

func TestPropertyFixed(t *testing.T) {
	for i, p := range fixedPairings() {
		if err := Compatible(p.prefill, p.gen); err != nil {
			t.Fatalf("pairing %d: %v", i, err)
		}
		t.Run(fmt.Sprintf("%d", i), func(t *testing.T) { checkPairing(t, p) })
	}
}

func TestPropertyRandom(t *testing.T) {
	n := 1500
	if testing.Short() {
		n = 100
	}
	r := rand.New(rand.NewPCG(20251, 7))
	// Count what the draw covered, so that a change to the generator cannot
	// silently stop exercising a case.
	seen := map[string]int{}
	for range n {
		p := randomPairing(r)
		for _, s := range []CacheState{p.prefill, p.gen} {
			seen["dtype "+s.Shape.DType.String()]++
			seen[fmt.Sprintf("kv_factor %d", s.Shape.KVFactor)]++
			if s.Parallel.TP%3 == 0 {
				seen["tp not a power of two"]++
			}
			if len(s.Parallel.LayersPerPP) > 0 && slices.Min(s.Parallel.LayersPerPP) != slices.Max(s.Parallel.LayersPerPP) {
				seen["uneven pp"]++
			}
			if s.Attention == AttentionDefault && s.Shape.KVHeads < s.Parallel.TPPerDP() {
				seen["duplicated heads"]++
			}
		}
		if p.gen.Parallel.AttentionDP && p.gen.Parallel.DPSize > 1 {
			seen["gen attention dp"]++
		}
		if p.prefill.Attention == AttentionMLA {
			seen["mla"]++
		}
		if p.prefill.Parallel.TP != p.gen.Parallel.TP && p.prefill.Parallel.PP != p.gen.Parallel.PP {
			seen["tp and pp both differ"]++
		}
		checkPairing(t, p)
	}
	for _, k := range []string{
		"dtype fp32", "dtype fp16", "dtype bf16", "dtype fp8", "dtype int8", "kv_factor 1", "kv_factor 2",
		"tp not a power of two", "uneven pp", "duplicated heads", "gen attention dp", "mla", "tp and pp both differ",
	} {
		if seen[k] < n/50 {
			t.Errorf("only %d of %d random pairings cover %q", seen[k], n, k)
		}
	}
	t.Logf("coverage: %v", seen)
}

// TestFixedPairingsStream checks that the fixed pairings take Pack's and
// Unpack's non-temporal path somewhere, so that checkPairing compares it with
// the reference through the exported functions too.
func TestFixedPairingsStream(t *testing.T) {
	packs, unpacks := 0, 0
	for _, p := range fixedPairings() {
		nb := NumBlocks(p.tokens, p.prefill.Shape.TokensPerBlock)
		for _, c := range groupRanks(p.prefill) {
			targets, err := TargetRanks(p.gen, p.prefill, c)
			if err != nil {
				t.Fatalf("%v\nTargetRanks(ctx %d): %v", p, c, err)
			}
			for _, g := range targets {
				plan := mustPlan(t, p.prefill, c, p.gen, g)
				n := nb * int(plan.PackedBytesPerBlock())
				if streams(n, plan.srcSpans) && len(plan.srcSpans) > 1 {
					packs++
				}
				if streams(n, plan.dstSpans) && len(plan.dstSpans) > 1 {
					unpacks++
				}
			}
		}
	}
	if packs == 0 || unpacks == 0 {
		t.Fatalf("the fixed pairings stream in %d packs and %d unpacks of several spans, want some of each", packs, unpacks)
	}
}

// TestShardMatchesLogical checks the reference itself on a small case worked
// out by hand: TP2, 2 heads, 1 layer, K only, int8, one dim.
func TestShardMatchesLogical(t *testing.T) {
	sh := kvcache.Shape{Layers: 1, KVHeads: 2, HeadDim: 1, TokensPerBlock: 2, KVFactor: 1, DType: kvcache.INT8}
	l, err := NewLogical(sh, 3)
	if err != nil {
		t.Fatal(err)
	}
	copy(l.Data, []byte{10, 11, 12, 20, 21, 22}) // head 0: tokens 10,11,12; head 1: 20,21,22
	for rank, want := range [][][]byte{{{10, 11}, {12, 0}}, {{20, 21}, {22, 0}}} {
		got, err := Shard(l, state(sh, 2, 1), rank)
		if err != nil || !slices.EqualFunc(got, want, bytes.Equal) {
			t.Errorf("Shard rank %d = %v, %v; want %v", rank, got, err, want)
		}
	}
	// TP4 duplicates each head on two ranks.
	got, err := Shard(l, state(sh, 4, 1), 3)
	if err != nil || !slices.EqualFunc(got, [][]byte{{20, 21}, {22, 0}}, bytes.Equal) {
		t.Errorf("Shard TP4 rank 3 = %v, %v", got, err)
	}
	l2, _ := NewLogical(sh, 3)
	l2.Fill(99)
	l3, _ := NewLogical(sh, 3)
	l3.Fill(99)
	if !bytes.Equal(l2.Data, l3.Data) {
		t.Error("Fill is not deterministic")
	}
	if _, err := Shard(l, state(llama8B, 1, 1), 0); err == nil {
		t.Error("Shard accepted a state of another shape")
	}
	if _, err := NewLogical(llama8B, 1<<20); err == nil {
		t.Error("NewLogical accepted a 128 GiB cache")
	}
}
