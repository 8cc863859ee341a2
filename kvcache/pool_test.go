package kvcache

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
)

type fakeAllocator struct {
	size int // bytes to return, if err is nil
	err  error
}

func (f fakeAllocator) Allocate(int) (Arena, error) {
	if f.err != nil {
		return nil, f.err
	}
	return &heapArena{b: make([]byte, f.size)}, nil
}

func TestNewPoolErrors(t *testing.T) {
	errAlloc := errors.New("no memory for you")
	// 2^20 of each dimension overflows int64 in one block; 2^12 makes
	// blocks of 2^52 bytes, 4 of which exceed the largest arena.
	hugeBlock := BlockLayout{Layers: 1 << 20, KVFactor: 2, Heads: 1 << 20, TokensPerBlock: 1 << 20, HeadDim: 1 << 20, ElemSize: 8}
	hugePool := BlockLayout{Layers: 1 << 12, KVFactor: 2, Heads: 1 << 12, TokensPerBlock: 1 << 12, HeadDim: 1 << 12, ElemSize: 8}
	tests := []struct {
		name      string
		layout    BlockLayout
		numBlocks int
		alloc     Allocator
		want      error  // errors.Is target, if any
		wantMsg   string // substring of the message
	}{
		{"zero layout", BlockLayout{}, 4, nil, ErrInvalidShape, "kvcache: invalid shape: block layout"},
		{"zero blocks", testLayout, 0, nil, nil, "kvcache: pool of 0 blocks"},
		{"negative blocks", testLayout, -1, nil, nil, "kvcache: pool of -1 blocks"},
		{"too many blocks", testLayout, MaxBlocks + 1, nil, nil, "want 1..2147483646"},
		{"block overflows int64", hugeBlock, 1, nil, ErrInvalidShape, "do not fit in one arena"},
		{"pool overflows int64", hugePool, 4, nil, ErrInvalidShape, "do not fit in one arena"},
		{"allocator error", testLayout, 4, fakeAllocator{err: errAlloc}, errAlloc, "no memory for you"},
		{"allocator short", testLayout, 4, fakeAllocator{size: 100}, nil, "kvcache: allocator kvcache.fakeAllocator returned 100 bytes, want 128"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewPool(tt.layout, tt.numBlocks, tt.alloc)
			if err == nil {
				p.Close()
				t.Fatal("NewPool succeeded, want an error")
			}
			if tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("error %v, want one wrapping %v", err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q, want it to contain %q", err, tt.wantMsg)
			}
		})
	}
}

func TestNewPool(t *testing.T) {
	p := newTestPool(t, 5)
	if got, want := p.Stats(), (Stats{Total: 5, Free: 5}); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
	if p.NumBlocks() != 5 || p.BlockBytes() != 32 || p.Layout() != testLayout || p.FreeBlocks() != 5 || p.CachedBlocks() != 0 {
		t.Errorf("NumBlocks %d, BlockBytes %d, Layout %+v, FreeBlocks %d, CachedBlocks %d",
			p.NumBlocks(), p.BlockBytes(), p.Layout(), p.FreeBlocks(), p.CachedBlocks())
	}
	if got := len(p.Arena().Bytes()); got != 5*32 {
		t.Errorf("arena is %d bytes, want %d", got, 5*32)
	}
	ids, err := p.Allocate(5)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]BlockID{0, 1, 2, 3, 4}, ids); diff != "" {
		t.Errorf("a fresh pool hands out blocks in order (-want +got):\n%s", diff)
	}
	arena := p.Arena().Bytes()
	for _, id := range ids {
		b := p.Block(id)
		if len(b) != 32 || cap(b) != 32 {
			t.Errorf("Block(%d): len %d cap %d, want 32 32", id, len(b), cap(b))
		}
		off := p.BlockOffset(id)
		if off != int64(id)*32 {
			t.Errorf("BlockOffset(%d) = %d, want %d", id, off, int64(id)*32)
		}
		b[0], b[31] = byte(id)+1, byte(id)+100
		if arena[off] != byte(id)+1 || arena[off+31] != byte(id)+100 {
			t.Errorf("Block(%d) does not alias the arena at offset %d", id, off)
		}
	}
	if err := p.Release(ids...); err != nil {
		t.Fatal(err)
	}
}

func TestAllocateAllOrNothing(t *testing.T) {
	tests := []struct {
		blocks, pinned, cached, n int
		wantErr                   bool
	}{
		{blocks: 4, n: 0},
		{blocks: 4, n: 4},
		{blocks: 4, n: 5, wantErr: true},
		{blocks: 4, pinned: 1, n: 3},
		{blocks: 4, pinned: 1, n: 4, wantErr: true},
		{blocks: 4, pinned: 1, cached: 2, n: 3},                // evicts both cached blocks
		{blocks: 4, pinned: 2, cached: 2, n: 3, wantErr: true}, // cached blocks count, but not enough
		{blocks: 4, pinned: 4, n: 1, wantErr: true},            // all pinned
		{blocks: 4, n: math.MaxInt, wantErr: true},             // no giant allocation
		{blocks: 1, cached: 1, n: 1},                           // only a cached block
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%+v", tt), func(t *testing.T) {
			p := newTestPool(t, tt.blocks)
			pinned, err := p.Allocate(tt.pinned + tt.cached)
			if err != nil {
				t.Fatal(err)
			}
			for i, id := range pinned[tt.pinned:] {
				if ok, err := p.Commit(id, hashN(i)); !ok || err != nil {
					t.Fatalf("Commit: %v %v", ok, err)
				}
			}
			if err := p.Release(pinned[tt.pinned:]...); err != nil {
				t.Fatal(err)
			}
			before := p.Stats()
			if before.Cached != tt.cached || before.Pinned != tt.pinned {
				t.Fatalf("setup: %+v", before)
			}
			ids, err := p.Allocate(tt.n)
			if tt.wantErr {
				if !errors.Is(err, ErrPoolExhausted) || ids != nil {
					t.Fatalf("Allocate(%d) = %v, %v; want nil, ErrPoolExhausted", tt.n, ids, err)
				}
				if after := p.Stats(); after != before {
					t.Errorf("failed Allocate changed the pool: %+v → %+v", before, after)
				}
				return
			}
			if err != nil || len(ids) != tt.n {
				t.Fatalf("Allocate(%d) = %v, %v", tt.n, ids, err)
			}
			want := before
			want.Pinned += tt.n
			evicted := max(0, tt.n-before.Free)
			want.Free -= tt.n - evicted
			want.Cached -= evicted
			want.Indexed -= evicted
			want.Evictions += uint64(evicted)
			if diff := cmp.Diff(want, p.Stats()); diff != "" {
				t.Errorf("Stats after Allocate (-want +got):\n%s", diff)
			}
			checkConsistent(t, p)
		})
	}
}

func TestExhaustedMessage(t *testing.T) {
	p := newTestPool(t, 2)
	_, err := p.Allocate(3)
	const want = "kvcache: pool exhausted: want 3 blocks, 2 available (2 free, 0 cached) of 2"
	if err == nil || err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
}

func TestRefcounts(t *testing.T) {
	p := newTestPool(t, 2)
	ids, _ := p.Allocate(1)
	id := ids[0]
	if err := p.Retain(id, id); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if p.Block(id) == nil {
			t.Fatalf("Block(%d) = nil with %d references", id, 3-i)
		}
		if got := p.Stats().Pinned; got != 1 {
			t.Fatalf("Pinned = %d, want 1", got)
		}
		if err := p.Release(id); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	if got, want := p.Stats(), (Stats{Total: 2, Free: 2}); got != want {
		t.Errorf("Stats = %+v, want %+v", got, want)
	}
	// Release in one call, the same id twice.
	ids, _ = p.Allocate(1)
	p.Retain(ids[0])
	if err := p.Release(ids[0], ids[0]); err != nil {
		t.Fatal(err)
	}
	if got := p.Stats().Free; got != 2 {
		t.Errorf("Free = %d, want 2", got)
	}
	checkConsistent(t, p)
}

func TestMisuse(t *testing.T) {
	skipMisuse(t)
	h := hashN(1)
	tests := []struct {
		name    string
		op      func(p *Pool, pinned, free BlockID) error
		want    error
		wantID  BlockID // -1: pinned's id, -2: free's id
		wantMsg string
	}{
		{"release free block", func(p *Pool, _, free BlockID) error { return p.Release(free) }, ErrDoubleFree, -2, "kvcache: release block 1: double free"},
		{"release twice in one call", func(p *Pool, pinned, _ BlockID) error { return p.Release(pinned, pinned) }, ErrDoubleFree, -1, "double free"},
		{"release out of range", func(p *Pool, pinned, _ BlockID) error { return p.Release(pinned, 3) }, ErrBadBlock, 3, "kvcache: release block 3: bad block id (out of range [0, 3))"},
		{"release negative", func(p *Pool, _, _ BlockID) error { return p.Release(-1) }, ErrBadBlock, -1000, "block -1"},
		{"retain free block", func(p *Pool, pinned, free BlockID) error { return p.Retain(pinned, free) }, ErrBadBlock, -2, "retain block 1: bad block id (not pinned)"},
		{"retain out of range", func(p *Pool, _, _ BlockID) error { return p.Retain(7) }, ErrBadBlock, 7, "out of range"},
		{"commit free block", func(p *Pool, _, free BlockID) error { _, err := p.Commit(free, h); return err }, ErrBadBlock, -2, "not pinned"},
		{"commit out of range", func(p *Pool, _, _ BlockID) error { _, err := p.Commit(math.MaxInt32, h); return err }, ErrBadBlock, math.MaxInt32, "out of range"},
		{"commit under another hash", func(p *Pool, pinned, _ BlockID) error {
			if _, err := p.Commit(pinned, h); err != nil {
				return err
			}
			_, err := p.Commit(pinned, hashN(2))
			return err
		}, ErrCommitted, -1, "already committed"},
		{"negative allocate", func(p *Pool, _, _ BlockID) error { _, err := p.Allocate(-1); return err }, nil, 0, "negative count"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPool(t, 3)
			ids, _ := p.Allocate(2) // 0 and 1
			pinned, free := ids[0], ids[1]
			p.Release(free)
			before := p.Stats()
			err := tt.op(p, pinned, free)
			if err == nil {
				t.Fatal("no error")
			}
			if tt.want != nil {
				if !errors.Is(err, tt.want) {
					t.Errorf("error %v, want one wrapping %v", err, tt.want)
				}
				wantID := tt.wantID
				switch wantID {
				case -1:
					wantID = pinned
				case -2:
					wantID = free
				case -1000:
					wantID = -1
				}
				var be *BlockError
				if !errors.As(err, &be) || be.ID != wantID {
					t.Errorf("error %v: want a *BlockError for block %d", err, wantID)
				}
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q, want it to contain %q", err, tt.wantMsg)
			}
			after := p.Stats()
			after.Indexed = before.Indexed // the commit test commits first
			if after != before {
				t.Errorf("failed operation changed the pool: %+v → %+v", before, after)
			}
			if p.refs[pinned].Load() != 1 {
				t.Errorf("refcount of the pinned block is %d, want 1", p.refs[pinned].Load())
			}
			checkConsistent(t, p)
		})
	}
}

func TestBlockOfUnpinned(t *testing.T) {
	skipMisuse(t)
	p := newTestPool(t, 2)
	ids, _ := p.Allocate(2)
	p.Commit(ids[1], hashN(1))
	p.Release(ids...) // 0 free, 1 cached
	for _, id := range []BlockID{0, 1, 2, -1} {
		if b := p.Block(id); b != nil {
			t.Errorf("Block(%d) = %d bytes, want nil", id, len(b))
		}
		if off := p.BlockOffset(id); off != -1 {
			t.Errorf("BlockOffset(%d) = %d, want -1", id, off)
		}
	}
}

// TestBlocks: Blocks returns the pinned blocks' memory in order, each
// capped at its block, and names the first block that is not pinned, out
// of range or of a closed pool, without panicking even under the
// invariants tag.
func TestBlocks(t *testing.T) {
	p := newTestPool(t, 4)
	ids, _ := p.Allocate(3)
	mem, err := p.Blocks([]BlockID{ids[2], ids[0]})
	if err != nil || len(mem) != 2 || &mem[0][0] != &p.Block(ids[2])[0] || &mem[1][0] != &p.Block(ids[0])[0] ||
		int64(cap(mem[0])) != p.BlockBytes() {
		t.Fatalf("Blocks of two pinned blocks: %d slices, %v; want their memory in order, each capped at its block", len(mem), err)
	}
	p.Release(ids[1])
	for _, tc := range []struct {
		ids  []BlockID
		want string
	}{
		{[]BlockID{ids[0], ids[1]}, fmt.Sprintf("kvcache: use block %d: bad block id (not pinned)", ids[1])},
		{[]BlockID{ids[0], 4}, "kvcache: use block 4: bad block id (out of range [0, 4))"},
		{[]BlockID{-1}, "kvcache: use block -1: bad block id (out of range [0, 4))"},
	} {
		mem, err := p.Blocks(tc.ids)
		var be *BlockError
		if mem != nil || !errors.As(err, &be) || !errors.Is(err, ErrBadBlock) || err.Error() != tc.want {
			t.Errorf("Blocks(%v) = %d slices, %v; want %q", tc.ids, len(mem), err, tc.want)
		}
	}
	p.Close()
	if _, err := p.Blocks(ids[:1]); !errors.Is(err, ErrClosed) {
		t.Errorf("Blocks after Close: %v, want %v", err, ErrClosed)
	}
}

func TestReuse(t *testing.T) {
	p := newTestPool(t, 3)
	h1, h2 := hashN(1), hashN(2)
	ids, _ := p.Allocate(2)
	a, b := ids[0], ids[1]
	copy(p.Block(a), "block a")
	if ok, err := p.Commit(a, h1); !ok || err != nil {
		t.Fatalf("Commit(a, h1) = %v, %v", ok, err)
	}
	if ok, err := p.Commit(a, h1); !ok || err != nil {
		t.Fatalf("Commit(a, h1) again = %v, %v; want true, nil", ok, err)
	}
	if ok, err := p.Commit(b, h1); ok || err != nil {
		t.Fatalf("Commit(b, h1) = %v, %v; want false, nil (a was first)", ok, err)
	}
	// A committed pinned block is found and shared.
	if id, ok := p.Lookup(h1); !ok || id != a {
		t.Fatalf("Lookup(h1) = %d, %v; want %d", id, ok, a)
	}
	if _, ok := p.Lookup(h2); ok {
		t.Fatal("Lookup(h2) found a block")
	}
	if err := p.Release(a, a, b); err != nil {
		t.Fatal(err)
	}
	want := Stats{Total: 3, Free: 2, Cached: 1, Indexed: 1, Hits: 1, Misses: 1}
	if diff := cmp.Diff(want, p.Stats()); diff != "" {
		t.Fatalf("after release (-want +got):\n%s", diff)
	}
	if p.FreeBlocks() != 3 || p.CachedBlocks() != 1 {
		t.Errorf("FreeBlocks %d CachedBlocks %d, want 3 1", p.FreeBlocks(), p.CachedBlocks())
	}
	// A cached block is found again with its contents.
	id, ok := p.Lookup(h1)
	if !ok || id != a || string(p.Block(a)[:7]) != "block a" {
		t.Fatalf("Lookup(h1) after release = %d, %v", id, ok)
	}
	if got := p.Stats(); got.Cached != 0 || got.Pinned != 1 {
		t.Errorf("Lookup did not pin the cached block: %+v", got)
	}
	p.Release(a)
	// Allocating the whole pool evicts it; it is never found again.
	ids, _ = p.Allocate(3)
	if _, ok := p.Lookup(h1); ok {
		t.Fatal("Lookup found an evicted block")
	}
	if got := p.Stats(); got.Evictions != 1 || got.Indexed != 0 {
		t.Errorf("after eviction: %+v", got)
	}
	// Committing the reallocated block under the old hash is allowed.
	if ok, err := p.Commit(a, h1); !ok || err != nil {
		t.Errorf("Commit after eviction = %v, %v", ok, err)
	}
	p.Release(ids...)
	checkConsistent(t, p)
}

func TestEvictionOrder(t *testing.T) {
	// Each step releases blocks (already committed under hashN(id)), or
	// looks one up again ("L<id>"), or allocates ("A<n>"); the test records
	// which committed blocks each allocation evicted, in order.
	tests := []struct {
		name  string
		steps []string
		want  []BlockID // blocks evicted, in order
	}{
		{"release order", []string{"R0", "R1", "R2", "R3", "A4"}, []BlockID{0, 1, 2, 3}},
		{"reverse release", []string{"R3", "R2", "R1", "R0", "A2"}, []BlockID{3, 2}},
		{"one call keeps argument order", []string{"R2,0,3,1", "A4"}, []BlockID{2, 0, 3, 1}},
		{"lookup refreshes", []string{"R0", "R1", "R2", "R3", "L0", "R0", "A2"}, []BlockID{1, 2}},
		{"pinned twice, last release counts", []string{"L0", "R0", "R1", "R2", "R3", "R0", "A3"}, []BlockID{1, 2, 3}},
		{"a block listed twice counts at its last release", []string{"L1", "R1,0,1", "A2"}, []BlockID{0, 1}},
		{"clean free blocks go first", []string{"R0", "R1", "F", "A1", "A1"}, []BlockID{0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestPool(t, 5) // blocks 0..3 committed, block 4 kept pinned
			ids, _ := p.Allocate(5)
			for _, id := range ids[:4] {
				p.Commit(id, hashN(int(id)))
			}
			var evicted []BlockID
			for _, step := range tt.steps {
				switch step[0] {
				case 'R':
					var rel []BlockID
					for _, s := range strings.Split(step[1:], ",") {
						var id BlockID
						fmt.Sscan(s, &id)
						rel = append(rel, id)
					}
					if err := p.Release(rel...); err != nil {
						t.Fatalf("%s: %v", step, err)
					}
				case 'L':
					var id int
					fmt.Sscan(step[1:], &id)
					if got, ok := p.Lookup(hashN(id)); !ok || got != BlockID(id) {
						t.Fatalf("%s: Lookup = %d, %v", step, got, ok)
					}
				case 'F': // release the uncommitted block 4: a clean free block
					p.Release(ids[4])
				case 'A':
					var n int
					fmt.Sscan(step[1:], &n)
					before := p.Stats().Evictions
					got, err := p.Allocate(n)
					if err != nil {
						t.Fatalf("%s: %v", step, err)
					}
					for _, id := range got {
						if id < 4 {
							evicted = append(evicted, id)
						}
					}
					if p.Stats().Evictions-before != uint64(countBelow(got, 4)) {
						t.Errorf("%s: Evictions did not count the evicted blocks", step)
					}
				}
				checkConsistent(t, p)
			}
			if diff := cmp.Diff(tt.want, evicted); diff != "" {
				t.Errorf("eviction order (-want +got):\n%s", diff)
			}
		})
	}
}

func countBelow(ids []BlockID, n BlockID) int {
	c := 0
	for _, id := range ids {
		if id < n {
			c++
		}
	}
	return c
}

func TestMatchPrefix(t *testing.T) {
	const tpb = 4
	p := newTestPool(t, 8)
	prompt := []int32{10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41}
	hashes := HashBlocks(Hash{}, prompt, tpb) // 3 full blocks
	var table BlockTable
	if _, err := table.Grow(p, len(prompt)); err != nil {
		t.Fatal(err)
	}
	for i, h := range hashes {
		p.Commit(table.IDs()[i], h)
	}
	cachedIDs := append([]BlockID(nil), table.IDs()[:3]...)
	if err := table.Release(p); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name   string
		tokens []int32
		want   []BlockID
	}{
		{"same prompt", prompt, cachedIDs},
		{"longer prompt", append(append([]int32(nil), prompt[:12]...), 50, 51, 52, 53), cachedIDs},
		{"prefix of two blocks", prompt[:9], cachedIDs[:2]},
		{"diverges in block 1", []int32{10, 11, 12, 13, 20, 21, 22, 99, 30, 31, 32, 33}, cachedIDs[:1]},
		{"diverges in block 0", []int32{10, 11, 12, 99, 20, 21, 22, 23}, nil},
		{"same block 1, other block 0", []int32{99, 11, 12, 13, 20, 21, 22, 23}, nil},
		{"partial block only", prompt[:3], nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := p.MatchPrefix(HashBlocks(Hash{}, tt.tokens, tpb))
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("MatchPrefix (-want +got):\n%s", diff)
			}
			if got := p.Stats().Pinned; got != len(tt.want) {
				t.Errorf("Pinned = %d, want %d", got, len(tt.want))
			}
			if err := p.Release(got...); err != nil {
				t.Fatal(err)
			}
		})
	}
	if s := p.Stats(); s.Pinned != 0 || s.Available() != s.Total {
		t.Errorf("leak: %+v", s)
	}
}

func TestClose(t *testing.T) {
	p, err := NewPool(testLayout, 3, MmapAllocator{})
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := p.Allocate(2)
	p.Commit(ids[0], hashN(0))
	err = p.Close()
	if !errors.Is(err, ErrBlocksInUse) || !strings.Contains(err.Error(), "2 of 3 blocks pinned") {
		t.Errorf("Close = %v, want ErrBlocksInUse with 2 of 3 blocks", err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
	if p.Arena().Bytes() != nil {
		t.Error("Close did not close the arena")
	}
	if _, err := p.Allocate(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Allocate after Close = %v", err)
	}
	if err := p.Release(ids...); !errors.Is(err, ErrClosed) {
		t.Errorf("Release after Close = %v", err)
	}
	if err := p.Retain(ids...); !errors.Is(err, ErrClosed) {
		t.Errorf("Retain after Close = %v", err)
	}
	if _, err := p.Commit(ids[1], hashN(1)); !errors.Is(err, ErrClosed) {
		t.Errorf("Commit after Close = %v", err)
	}
	if _, ok := p.Lookup(hashN(0)); ok {
		t.Error("Lookup after Close found a block")
	}
	if got := p.MatchPrefix([]Hash{hashN(0)}); got != nil {
		t.Errorf("MatchPrefix after Close = %v", got)
	}
	if p.Block(ids[0]) != nil || p.BlockOffset(ids[0]) != -1 {
		t.Error("Block or BlockOffset after Close returned memory")
	}
	if got := p.Stats(); got.Pinned != 2 {
		t.Errorf("Stats after Close = %+v, want the counts at close", got)
	}

	clean := newTestPool(t, 2)
	ids, _ = clean.Allocate(2)
	clean.Release(ids...)
	if err := clean.Close(); err != nil {
		t.Errorf("Close of an idle pool = %v", err)
	}
}

// TestConcurrent runs requests with shared prefixes from several goroutines
// (under -race in CI). Each request stamps the blocks it computes; a block
// handed to two owners at once, or found by hash after being reused, shows
// up as a wrong stamp.
func TestConcurrent(t *testing.T) {
	const (
		workers  = 8
		requests = 300
		tpb      = 4
	)
	layout := testLayout
	p, err := NewPool(layout, 16, MmapAllocator{})
	if err != nil {
		t.Fatal(err)
	}
	// Prompts of 3 full blocks and a partial one that share prefixes: 1 + 3
	// + 16 distinct full blocks, more than the pool holds.
	var prompts [][]int32
	for i := range 16 {
		prompts = append(prompts, []int32{1, 2, 3, 4, int32(i % 3), 6, 7, 8, int32(i), 9, 9, 9, 5})
	}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			errs <- concurrentWorker(p, w, requests, prompts)
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	s := p.Stats()
	if s.Pinned != 0 || s.Available() != s.Total {
		t.Errorf("leak: %+v", s)
	}
	if s.Hits == 0 || s.Evictions == 0 {
		t.Errorf("the test did not exercise reuse and eviction: %+v", s)
	}
	checkConsistent(t, p)
	if err := p.Close(); err != nil {
		t.Error(err)
	}
}

func concurrentWorker(p *Pool, w, requests int, prompts [][]int32) error {
	tpb := p.Layout().TokensPerBlock
	for r := range requests {
		prompt := prompts[(w+r)%len(prompts)]
		hashes := HashBlocks(Hash{}, prompt, tpb)
		var table BlockTable
		table.Append(p.MatchPrefix(hashes)...)
		reused := table.Len()
		for i, id := range table.IDs() {
			if got := Hash(p.Block(id)[:16]); got != hashes[i] {
				return fmt.Errorf("worker %d: reused block %d holds %v, want %v", w, id, got, hashes[i])
			}
		}
		if _, err := table.Grow(p, len(prompt)); err != nil {
			if !errors.Is(err, ErrPoolExhausted) {
				return err
			}
			if err := table.Release(p); err != nil {
				return err
			}
			continue
		}
		// Stamp the new blocks: the block's hash if it is full, else the
		// owner.
		stamp := Hash{0: 0xff, 1: byte(w), 2: byte(r), 3: byte(r >> 8)}
		for i, id := range table.IDs()[reused:] {
			i += reused
			if i < len(hashes) {
				copy(p.Block(id), hashes[i][:])
				if _, err := p.Commit(id, hashes[i]); err != nil {
					return err
				}
			} else {
				copy(p.Block(id), stamp[:])
			}
		}
		for i, id := range table.IDs() {
			want := stamp
			if i < len(hashes) {
				want = hashes[i]
			}
			if got := Hash(p.Block(id)[:16]); got != want {
				return fmt.Errorf("worker %d: block %d holds %v, want %v: handed out twice?", w, id, got, want)
			}
		}
		if err := table.Release(p); err != nil {
			return err
		}
	}
	return nil
}
