package kvcache

import (
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestBlocksForTokens(t *testing.T) {
	tests := []struct{ tokens, tpb, want int }{
		{0, 32, 0}, {-5, 32, 0}, {1, 32, 1}, {32, 32, 1}, {33, 32, 2}, {4096, 32, 128}, {4097, 32, 129}, {7, 1, 7},
	}
	for _, tt := range tests {
		if got := BlocksForTokens(tt.tokens, tt.tpb); got != tt.want {
			t.Errorf("BlocksForTokens(%d, %d) = %d, want %d", tt.tokens, tt.tpb, got, tt.want)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("BlocksForTokens(1, 0) did not panic")
		}
	}()
	BlocksForTokens(1, 0)
}

func TestBlockTable(t *testing.T) {
	p := newTestPool(t, 6) // 4 tokens per block
	var tb BlockTable
	if tb.Len() != 0 || len(tb.Last(3)) != 0 || len(tb.IDs()) != 0 {
		t.Fatal("zero table not empty")
	}
	steps := []struct {
		tokens    int
		wantAdded int
		wantIDs   []BlockID
	}{
		{tokens: 5, wantAdded: 2, wantIDs: []BlockID{0, 1}},
		{tokens: 8, wantAdded: 0, wantIDs: []BlockID{0, 1}},
		{tokens: 9, wantAdded: 1, wantIDs: []BlockID{0, 1, 2}},
		{tokens: 3, wantAdded: 0, wantIDs: []BlockID{0, 1, 2}}, // never shrinks
	}
	for _, s := range steps {
		added, err := tb.Grow(p, s.tokens)
		if err != nil || added != s.wantAdded {
			t.Fatalf("Grow(%d) = %d, %v; want %d", s.tokens, added, err, s.wantAdded)
		}
		if diff := cmp.Diff(s.wantIDs, tb.IDs()); diff != "" {
			t.Fatalf("after Grow(%d) (-want +got):\n%s", s.tokens, diff)
		}
	}
	for n, want := range map[int][]BlockID{-1: {}, 0: {}, 1: {2}, 2: {1, 2}, 3: {0, 1, 2}, 10: {0, 1, 2}} {
		if diff := cmp.Diff(want, tb.Last(n)); diff != "" {
			t.Errorf("Last(%d) (-want +got):\n%s", n, diff)
		}
	}
	// Exhaustion leaves the table unchanged.
	if _, err := tb.Grow(p, 100); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("Grow(100) = %v, want ErrPoolExhausted", err)
	}
	if tb.Len() != 3 || p.Stats().Pinned != 3 {
		t.Fatalf("failed Grow changed the table or pool: %v %+v", tb.IDs(), p.Stats())
	}
	// Append takes over references, e.g. from MatchPrefix or Retain.
	p.Retain(0)
	tb.Append(0)
	if err := tb.Release(p); err != nil {
		t.Fatal(err)
	}
	if tb.Len() != 0 || p.Stats().Pinned != 0 {
		t.Errorf("after Release: table %v, %+v", tb.IDs(), p.Stats())
	}
	if err := tb.Release(p); err != nil {
		t.Errorf("Release of an empty table = %v", err)
	}
}

func TestBlockTableReleaseFailure(t *testing.T) {
	skipMisuse(t)
	p := newTestPool(t, 4)
	var tb BlockTable
	tb.Grow(p, 12)
	p.Release(tb.IDs()[1]) // behind the table's back
	want := append([]BlockID(nil), tb.IDs()...)
	if err := tb.Release(p); !errors.Is(err, ErrDoubleFree) {
		t.Fatalf("Release = %v, want ErrDoubleFree", err)
	}
	if diff := cmp.Diff(want, tb.IDs()); diff != "" {
		t.Errorf("failed Release changed the table (-want +got):\n%s", diff)
	}
	if got := p.Stats().Pinned; got != 2 {
		t.Errorf("Pinned = %d, want 2", got)
	}
}

// TestBlockTableReleaseOrder checks that the tail of a released request is
// evicted before its prefix, which later requests are likelier to share.
func TestBlockTableReleaseOrder(t *testing.T) {
	p := newTestPool(t, 4)
	tokens := seq(16, 0)
	hashes := HashBlocks(Hash{}, tokens, 4)
	var tb BlockTable
	tb.Grow(p, len(tokens))
	for i, id := range tb.IDs() {
		p.Commit(id, hashes[i])
	}
	if err := tb.Release(p); err != nil {
		t.Fatal(err)
	}
	ids, _ := p.Allocate(1) // evicts one block: the last one
	if ids[0] != 3 {
		t.Errorf("evicted block %d, want the last block 3", ids[0])
	}
	if got := p.MatchPrefix(hashes); len(got) != 3 {
		t.Errorf("prefix after evicting the tail: %v blocks, want 3", got)
	} else {
		p.Release(got...)
	}
	p.Release(ids...)
}
