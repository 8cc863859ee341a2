package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
)

// TestDecodeBatchMatchesAlone: a sequence decoded in a batch of 32 (of
// different lengths, one of them starting its decode from a prefill in
// the same layout) gives the logits and KV bytes it gives decoded alone,
// bit for bit, step after step, on several presets and layouts.
func TestDecodeBatchMatchesAlone(t *testing.T) {
	const batch, steps = 32, 6
	for _, tc := range []struct {
		preset string
		cfg    InstanceConfig
	}{
		{"tiny-gqa", InstanceConfig{}},
		{"tiny-gqa2", InstanceConfig{TP: 2, DType: kvcache.FP8E4M3}},
		{"tiny-mla", InstanceConfig{PP: 2}},
	} {
		t.Run(fmt.Sprintf("%s tp%d pp%d", tc.preset, max(tc.cfg.TP, 1), max(tc.cfg.PP, 1)), func(t *testing.T) {
			cfg := tc.cfg
			cfg.TokensPerBlock, cfg.PoolTokens = 8, batch*96
			in := newTestInstance(t, tc.preset, cfg)
			prompts := make([][]int32, batch)
			for i := range prompts {
				prompts[i] = prompt(fmt.Sprintf("sequence %d: %s", i, "abcdefghijklmnopqrstuvwxyz"[:3+(i*7)%24]))
			}
			// Alone: each sequence prefilled and decoded by itself.
			type ref struct {
				logits [][]float32
				kv     []byte
			}
			refs := make([]ref, batch)
			for i, p := range prompts {
				s := in.NewSequence()
				if err := s.Reserve(len(p) + steps); err != nil {
					t.Fatal(err)
				}
				lg, err := in.Prefill(s, p)
				if err != nil {
					t.Fatal(err)
				}
				for range steps {
					if lg, err = in.Decode(s, argmax(lg)); err != nil {
						t.Fatal(err)
					}
					refs[i].logits = append(refs[i].logits, lg)
				}
				if refs[i].kv, err = logicalKV(in, s); err != nil {
					t.Fatal(err)
				}
				if err := s.Release(); err != nil {
					t.Fatal(err)
				}
			}
			// Batched: the same sequences, every decode step one batch.
			seqs := make([]*Sequence, batch)
			next := make([]int32, batch)
			for i, p := range prompts {
				seqs[i] = in.NewSequence()
				defer seqs[i].Release()
				if err := seqs[i].Reserve(len(p) + steps); err != nil {
					t.Fatal(err)
				}
				lg, err := in.Prefill(seqs[i], p)
				if err != nil {
					t.Fatal(err)
				}
				next[i] = argmax(lg)
			}
			for k := range steps {
				lgs, err := in.DecodeBatch(seqs, next)
				if err != nil {
					t.Fatal(err)
				}
				for i, lg := range lgs {
					want := refs[i].logits[k]
					for v := range lg {
						if math.Float32bits(lg[v]) != math.Float32bits(want[v]) {
							t.Fatalf("step %d, sequence %d: logit %d = %v in the batch, %v alone", k, i, v, lg[v], want[v])
						}
					}
					next[i] = argmax(lg)
				}
			}
			for i, s := range seqs {
				kv, err := logicalKV(in, s)
				if err != nil {
					t.Fatal(err)
				}
				if string(kv) != string(refs[i].kv) {
					t.Fatalf("sequence %d: KV bytes differ between the batch and alone", i)
				}
			}
		})
	}
}

func argmax(lg []float32) int32 {
	best := 0
	for i, v := range lg {
		if v > lg[best] {
			best = i
		}
	}
	return int32(best)
}

// TestDecodeBatchErrors: a batch that cannot run is refused whole and
// changes no sequence.
func TestDecodeBatchErrors(t *testing.T) {
	in := newTestInstance(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 256})
	other := newTestInstance(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: 64})
	a, b, full, alien := in.NewSequence(), in.NewSequence(), in.NewSequence(), other.NewSequence()
	for _, s := range []*Sequence{a, b, full, alien} {
		defer s.Release()
		if err := s.Reserve(8); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.Prefill(full, prompt("seven b")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		seqs []*Sequence
		toks []int32
		want error
	}{
		{"lengths differ", []*Sequence{a, b}, []int32{1}, ErrBadRequest},
		{"empty", nil, nil, ErrBadRequest},
		{"twice", []*Sequence{a, b, a}, []int32{1, 2, 3}, ErrBadRequest},
		{"other instance", []*Sequence{a, alien}, []int32{1, 2}, ErrBadRequest},
		{"token out of vocabulary", []*Sequence{a, b}, []int32{1, VocabSize}, ErrBadRequest},
		{"no room", []*Sequence{a, full}, []int32{1, 2}, nil},
	} {
		_, err := in.DecodeBatch(tc.seqs, tc.toks)
		if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
		if a.Len() != 0 || b.Len() != 0 || full.Len() != 8 {
			t.Fatalf("%s: lengths %d, %d, %d after a refused batch, want 0, 0, 8", tc.name, a.Len(), b.Len(), full.Len())
		}
	}
}

// TestEngineBatchedDecode: 32 concurrent sampled requests, decoded by the
// engine in batches, draw exactly the tokens each draws alone on an
// instance of another layout.
func TestEngineBatchedDecode(t *testing.T) {
	const n = 32
	e := newTestEngine(t, "tiny-gqa", InstanceConfig{TokensPerBlock: 8, PoolTokens: n * 64}, Options{MaxBatch: n})
	ref := newTestInstance(t, "tiny-gqa", InstanceConfig{TP: 2, TokensPerBlock: 8, PoolTokens: 128})
	streams := make([]*Stream, n)
	for i := range n {
		seed := uint64(i)
		streams[i] = submit(t, e, context.Background(), Request{Prompt: prompt(fmt.Sprintf("batched %d", i)),
			MaxTokens: 8 + i%9, Sampling: Sampling{Temperature: 0.9, Seed: &seed}, IgnoreEOS: true})
	}
	for i, s := range streams {
		res := waitResult(t, s)
		want := generate(t, ref, prompt(fmt.Sprintf("batched %d", i)), 8+i%9, 0.9, uint64(i))
		if res.Final.Err != nil || fmt.Sprint(res.Tokens) != fmt.Sprint(want.tokens) {
			t.Errorf("request %d: %v (%v), alone %v", i, res.Tokens, res.Final.Err, want.tokens)
		}
	}
}
