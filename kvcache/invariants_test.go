//go:build invariants

package kvcache

import (
	"errors"
	"testing"
)

// TestInvariantsPanic checks that misuse panics, with an error wrapping the
// sentinel, in builds with the invariants tag.
func TestInvariantsPanic(t *testing.T) {
	tests := []struct {
		name string
		op   func(p *Pool, pinned, free BlockID)
		want error
	}{
		{"double free", func(p *Pool, _, free BlockID) { p.Release(free) }, ErrDoubleFree},
		{"release twice in one call", func(p *Pool, pinned, _ BlockID) { p.Release(pinned, pinned) }, ErrDoubleFree},
		{"release out of range", func(p *Pool, _, _ BlockID) { p.Release(99) }, ErrBadBlock},
		{"retain free", func(p *Pool, _, free BlockID) { p.Retain(free) }, ErrBadBlock},
		{"retain negative", func(p *Pool, _, _ BlockID) { p.Retain(-1) }, ErrBadBlock},
		{"commit free", func(p *Pool, _, free BlockID) { p.Commit(free, hashN(1)) }, ErrBadBlock},
		{"recommit", func(p *Pool, pinned, _ BlockID) { p.Commit(pinned, hashN(1)); p.Commit(pinned, hashN(2)) }, ErrCommitted},
		{"block of free", func(p *Pool, _, free BlockID) { p.Block(free) }, ErrBadBlock},
		{"block out of range", func(p *Pool, _, _ BlockID) { p.Block(3) }, ErrBadBlock},
		{"offset of free", func(p *Pool, _, free BlockID) { p.BlockOffset(free) }, ErrBadBlock},
		{"negative allocate", func(p *Pool, _, _ BlockID) { p.Allocate(-1) }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPool(t, 3)
			ids, _ := p.Allocate(2)
			p.Release(ids[1])
			defer func() {
				r := recover()
				err, ok := r.(error)
				if !ok {
					t.Fatalf("recovered %v, want a panic with an error", r)
				}
				if tt.want != nil && !errors.Is(err, tt.want) {
					t.Errorf("panic %v, want one wrapping %v", err, tt.want)
				}
			}()
			tt.op(p, ids[0], ids[1])
		})
	}
}

// TestInvariantsNoPanic checks that what is not misuse does not panic.
func TestInvariantsNoPanic(t *testing.T) {
	p := newTestPool(t, 2)
	if _, err := p.Allocate(3); !errors.Is(err, ErrPoolExhausted) {
		t.Errorf("Allocate(3) = %v", err)
	}
	ids, _ := p.Allocate(1)
	if err := p.Close(); !errors.Is(err, ErrBlocksInUse) {
		t.Errorf("Close = %v", err)
	}
	if err := p.Release(ids...); !errors.Is(err, ErrClosed) {
		t.Errorf("Release after Close = %v", err)
	}
	if p.Block(ids[0]) != nil {
		t.Error("Block after Close")
	}
}

// TestInvariantsCheckCatchesCorruption checks that the consistency check run
// after each operation notices a corrupted pool.
func TestInvariantsCheckCatchesCorruption(t *testing.T) {
	p := newTestPool(t, 3)
	ids, _ := p.Allocate(1)
	p.mu.Lock()
	p.free = append(p.free, ids[0]) // a pinned block on the free stack
	p.mu.Unlock()
	defer func() {
		if recover() == nil {
			t.Error("no panic")
		}
		p.mu.Lock()
		p.free = p.free[:len(p.free)-1]
		p.mu.Unlock()
	}()
	p.Retain(ids[0])
}
