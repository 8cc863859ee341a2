package engine

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
)

var (
	modelsMu sync.Mutex
	models   = map[string]*Model{}
)

// testModel returns the preset's model, built once per test binary.
func testModel(t testing.TB, preset string) *Model {
	t.Helper()
	modelsMu.Lock()
	defer modelsMu.Unlock()
	if m := models[preset]; m != nil {
		return m
	}
	cfg, err := Preset(preset)
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	models[preset] = m
	return m
}

// newTestInstance builds an instance closed at the end of the test, which
// fails if blocks are still pinned then.
func newTestInstance(t testing.TB, preset string, cfg InstanceConfig) *Instance {
	t.Helper()
	in, err := NewInstance(testModel(t, preset), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := in.Close(); err != nil {
			t.Errorf("instance close: %v", err)
		}
	})
	return in
}

// run is one generation on an instance without the engine.
type run struct {
	tokens []int32
	logits [][]float32 // of every step
	kv     []byte      // the logical KV of the prompt and the fed tokens
}

// generate prefills prompt and decodes n tokens greedily (or sampled with
// the seed when temp > 0), then gathers the whole KV cache.
func generate(t testing.TB, in *Instance, prompt []int32, n int, temp float64, seed uint64) run {
	t.Helper()
	s := in.NewSequence()
	defer func() {
		if err := s.Release(); err != nil {
			t.Error(err)
		}
	}()
	if err := s.Reserve(len(prompt) + n); err != nil {
		t.Fatal(err)
	}
	lg, err := in.Prefill(s, prompt)
	if err != nil {
		t.Fatal(err)
	}
	var out run
	for i := range n {
		out.logits = append(out.logits, lg)
		tok := sampleToken(lg, temp, seed, i)
		out.tokens = append(out.tokens, tok)
		if i == n-1 {
			break
		}
		if lg, err = in.Decode(s, tok); err != nil {
			t.Fatal(err)
		}
	}
	kv, err := logicalKV(in, s)
	if err != nil {
		t.Fatal(err)
	}
	out.kv = kv
	return out
}

// logicalKV gathers the sequence's KV cache from every rank into the
// unsharded order [layer][kv][head][token][dim] (dtype bytes), checking that
// duplicated heads hold the same bytes on every rank that holds them.
func logicalKV(in *Instance, s *Sequence) ([]byte, error) {
	st := in.State()
	sh := st.Shape
	n := s.Len()
	es := sh.DType.Size()
	row := sh.HeadDim * es
	out := make([]byte, sh.Layers*sh.KVFactor*sh.KVHeads*n*row)
	seen := make([]bool, sh.Layers*sh.KVFactor*sh.KVHeads*n)
	for _, r := range in.ranks {
		for l := range r.bl.Layers {
			for kv := range r.bl.KVFactor {
				for h := range r.bl.Heads {
					gl, gh := r.layerLo+l, r.kvLo+h
					for tok := range n {
						mem := r.pool.Block(s.blocks[r.idx][tok/in.tpb])
						off := int(r.bl.Offset(l, kv, h, tok%in.tpb))
						src := mem[off : off+row]
						i := ((gl*sh.KVFactor+kv)*sh.KVHeads+gh)*n + tok
						dst := out[i*row : (i+1)*row]
						if seen[i] {
							if !bytes.Equal(dst, src) {
								return nil, fmt.Errorf("duplicated head %d of layer %d differs on rank %d at token %d", gh, gl, r.idx, tok)
							}
							continue
						}
						seen[i] = true
						copy(dst, src)
					}
				}
			}
		}
	}
	return out, nil
}

// checkPoolsFree fails unless every pool of in has all its blocks free.
func checkPoolsFree(t testing.TB, in *Instance) {
	t.Helper()
	for r, p := range in.pools {
		if st := p.Stats(); st.Pinned != 0 {
			t.Errorf("rank %d: %d blocks pinned, want 0 (%+v)", r, st.Pinned, st)
		}
	}
}

func prompt(s string) []int32 { return Tokenizer{}.Encode(s) }
