package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// refBlockHash is the documented definition, written the obvious way.
func refBlockHash(parent Hash, tokens []int32) Hash {
	b := append([]byte(hashDomain), parent[:]...)
	for _, t := range tokens {
		b = binary.LittleEndian.AppendUint32(b, uint32(t))
	}
	sum := sha256.Sum256(b)
	return Hash(sum[:16])
}

func seq(n int, start int32) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = start + int32(i)*7919
	}
	return s
}

func TestBlockHash(t *testing.T) {
	root := Hash{}
	other := BlockHash(root, []int32{1})
	tests := []struct {
		name   string
		parent Hash
		tokens []int32
	}{
		{"empty", root, nil},
		{"one token", root, []int32{1}},
		{"negative token", root, []int32{-1, -2147483648}},
		{"block of 32", root, seq(32, 0)},
		{"chunked (more than one buffer)", root, seq(500, 3)},
		{"exactly one buffer", root, seq((256-len(hashDomain)-16)/4, 0)},
		{"non-root parent", other, seq(32, 0)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := BlockHash(tt.parent, tt.tokens)
			if want := refBlockHash(tt.parent, tt.tokens); got != want {
				t.Errorf("BlockHash = %v, want %v", got, want)
			}
			if again := BlockHash(tt.parent, tt.tokens); again != got {
				t.Errorf("BlockHash is not deterministic: %v then %v", got, again)
			}
		})
	}

	// The encoding is part of the contract between ranks and versions:
	// pin one value.
	if got, want := BlockHash(root, []int32{1, 2, 3, 4}).String(), refBlockHash(root, []int32{1, 2, 3, 4}).String(); got != want || len(got) != 32 {
		t.Errorf("String = %q, want %q (32 hex digits)", got, want)
	}
}

func TestBlockHashDistinguishes(t *testing.T) {
	root := Hash{}
	a := BlockHash(root, []int32{1, 2, 3, 4})
	for name, h := range map[string]Hash{
		"other parent":      BlockHash(a, []int32{1, 2, 3, 4}),
		"token order":       BlockHash(root, []int32{2, 1, 3, 4}),
		"one token differs": BlockHash(root, []int32{1, 2, 3, 5}),
		"shorter":           BlockHash(root, []int32{1, 2, 3}),
		"256 vs 1":          BlockHash(root, []int32{256, 2, 3, 4}),
	} {
		if h == a {
			t.Errorf("%s: same hash %v", name, h)
		}
	}
	if a.IsRoot() || !root.IsRoot() {
		t.Error("IsRoot wrong")
	}
}

func TestHashBlocks(t *testing.T) {
	tokens := seq(10, 1)
	b0 := BlockHash(Hash{}, tokens[0:4])
	b1 := BlockHash(b0, tokens[4:8])
	tests := []struct {
		name   string
		parent Hash
		tokens []int32
		tpb    int
		want   []Hash
	}{
		{"two full blocks, partial tail ignored", Hash{}, tokens, 4, []Hash{b0, b1}},
		{"exact", Hash{}, tokens[:8], 4, []Hash{b0, b1}},
		{"less than a block", Hash{}, tokens[:3], 4, nil},
		{"continue a chain", b0, tokens[4:10], 4, []Hash{b1}},
		{"one token per block", Hash{}, tokens[:2], 1, []Hash{BlockHash(Hash{}, tokens[:1]), BlockHash(BlockHash(Hash{}, tokens[:1]), tokens[1:2])}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := HashBlocks(tt.parent, tt.tokens, tt.tpb)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("HashBlocks (-want +got):\n%s", diff)
			}
		})
	}
	defer func() {
		if recover() == nil {
			t.Error("HashBlocks with 0 tokens per block did not panic")
		}
	}()
	HashBlocks(Hash{}, tokens, 0)
}

func FuzzBlockHash(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4}, []byte{0})
	f.Fuzz(func(t *testing.T, parent, raw []byte) {
		var p Hash
		copy(p[:], parent)
		tokens := make([]int32, len(raw)/4)
		for i := range tokens {
			tokens[i] = int32(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		if got, want := BlockHash(p, tokens), refBlockHash(p, tokens); got != want {
			t.Errorf("BlockHash = %v, want %v", got, want)
		}
	})
}
