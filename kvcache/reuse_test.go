package kvcache

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestRootHash(t *testing.T) {
	if !RootHash("").IsRoot() {
		t.Fatalf("RootHash(\"\") = %v, want the zero root", RootHash(""))
	}
	a, b := RootHash("tenant-a"), RootHash("tenant-b")
	if a.IsRoot() || b.IsRoot() || a == b {
		t.Fatalf("salted roots %v and %v: want distinct, non-zero", a, b)
	}
	if a != RootHash("tenant-a") {
		t.Fatal("RootHash is not deterministic")
	}
	toks := []int32{1, 2, 3, 4}
	if BlockHash(a, toks) == BlockHash(Hash{}, toks) {
		t.Fatal("a salted first block hashes like an unsalted one")
	}
}

func TestMatchPartial(t *testing.T) {
	p := newTestPool(t, 8)
	ids, _ := p.Allocate(3)
	parent := BlockHash(Hash{}, []int32{9, 9, 9, 9})
	blocks := [][]int32{{1, 2, 3, 4}, {1, 2, 7, 7}, {5, 6, 7, 8}}
	for i, toks := range blocks {
		h, ok, err := p.CommitTokens(ids[i], parent, toks)
		if err != nil || !ok || h != BlockHash(parent, toks) {
			t.Fatalf("CommitTokens block %d: %v %v %v", i, h, ok, err)
		}
	}
	if !invariants { // misuse panics under the invariants tag
		if _, ok, err := p.CommitTokens(ids[0], parent, []int32{1}); err == nil || ok {
			t.Fatalf("CommitTokens with 1 token: ok %v err %v", ok, err)
		}
	}
	tests := []struct {
		name   string
		parent Hash
		query  []int32
		want   int // matching tokens; 0: no match
		block  int // index in ids of the block found
	}{
		{"longest of two", parent, []int32{1, 2, 3, 0}, 3, 0},
		{"tie takes first", parent, []int32{1, 2, 0, 0}, 2, 0},
		{"second child", parent, []int32{1, 2, 7, 0}, 3, 1},
		{"whole block", parent, []int32{5, 6, 7, 8}, 4, 2},
		{"short query", parent, []int32{5}, 1, 2},
		{"no first token", parent, []int32{4, 2, 3, 4}, 0, 0},
		{"other parent", Hash{}, []int32{1, 2, 3, 4}, 0, 0},
		{"empty query", parent, nil, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := p.PeekPartial(tc.parent, tc.query, false); got != tc.want {
				t.Errorf("PeekPartial = %d, want %d", got, tc.want)
			}
			id, h, n, ok := p.MatchPartial(tc.parent, tc.query)
			if ok != (tc.want > 0) || n != tc.want {
				t.Fatalf("MatchPartial = %d, %d tokens, %v; want %d tokens", id, n, ok, tc.want)
			}
			if !ok {
				return
			}
			if id != ids[tc.block] || h != BlockHash(tc.parent, blocks[tc.block]) {
				t.Errorf("MatchPartial found block %d (hash %v), want %d", id, h, ids[tc.block])
			}
			if err := p.Release(id); err != nil {
				t.Fatal(err)
			}
		})
	}
	checkConsistent(t, p)
	// Released, the blocks stay cached and partially matchable; evicted,
	// they leave the partial index too.
	if err := p.Release(reversed(ids)...); err != nil {
		t.Fatal(err)
	}
	if got := p.PeekPartial(parent, []int32{5, 6}, false); got != 2 {
		t.Fatalf("cached block: PeekPartial = %d, want 2", got)
	}
	all, err := p.Allocate(8)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.PeekPartial(parent, []int32{5, 6}, false); got != 0 {
		t.Fatalf("after eviction: PeekPartial = %d, want 0", got)
	}
	checkConsistent(t, p)
	p.Release(all...)
}

func TestTrackEvictions(t *testing.T) {
	p := newTestPool(t, 4)
	p.TrackEvictions(true)
	ids, _ := p.Allocate(4)
	hs := HashBlocks(Hash{}, []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 4)
	for i, h := range hs {
		if ok, err := p.Commit(ids[i], h); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	// Release last first: the tail is evicted first.
	for _, id := range reversed(ids) {
		p.Release(id)
	}
	if got, lost := p.DrainEvicted(nil); len(got) != 0 || lost {
		t.Fatalf("nothing evicted yet: %v %v", got, lost)
	}
	// One free block, then two evictions.
	got, _ := p.Allocate(3)
	ev, lost := p.DrainEvicted(nil)
	if want := []Hash{hs[2], hs[1]}; !slices.Equal(ev, want) || lost {
		t.Fatalf("evicted %v (lost %v), want %v", ev, lost, want)
	}
	if ev, _ := p.DrainEvicted(nil); len(ev) != 0 {
		t.Fatalf("drained twice: %v", ev)
	}
	if n := p.PeekPrefix(hs); n != 1 {
		t.Fatalf("PeekPrefix = %d, want 1 (block 0 still cached)", n)
	}
	p.Release(got...)
	p.TrackEvictions(false)
	all, _ := p.Allocate(4)
	if ev, _ := p.DrainEvicted(nil); len(ev) != 0 {
		t.Fatalf("untracked evictions recorded: %v", ev)
	}
	p.Release(all...)
}

// TestPartialProperty checks MatchPartial and PeekPrefix against a naive
// scan of what was committed and not evicted, over random operations.
func TestPartialProperty(t *testing.T) {
	const nb, tpb = 16, 4
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := range 50 {
		p := newTestPool(t, nb)
		type entry struct {
			parent Hash
			toks   []int32
		}
		live := map[Hash]entry{} // what the reference says is indexed
		p.TrackEvictions(true)
		parents := []Hash{{}, RootHash("x"), BlockHash(Hash{}, []int32{0, 0, 0, 0})}
		var held []BlockID
		for range 60 {
			switch rng.IntN(3) {
			case 0: // allocate and commit a block with random tokens
				ids, err := p.Allocate(1)
				if err != nil {
					break
				}
				ev, _ := p.DrainEvicted(nil)
				for _, h := range ev {
					delete(live, h)
				}
				par := parents[rng.IntN(len(parents))]
				toks := make([]int32, tpb)
				for i := range toks {
					toks[i] = int32(rng.IntN(3))
				}
				h, ok, err := p.CommitTokens(ids[0], par, toks)
				if err != nil {
					t.Fatal(err)
				}
				if ok {
					live[h] = entry{par, toks}
				}
				held = append(held, ids[0])
			case 1: // release one
				if len(held) > 0 {
					i := rng.IntN(len(held))
					p.Release(held[i])
					held = slices.Delete(held, i, i+1)
				}
			case 2: // query
				par := parents[rng.IntN(len(parents))]
				q := make([]int32, 1+rng.IntN(tpb))
				for i := range q {
					q[i] = int32(rng.IntN(3))
				}
				want := 0
				for _, e := range live {
					if e.parent != par {
						continue
					}
					k := 0
					for k < len(q) && e.toks[k] == q[k] {
						k++
					}
					want = max(want, k)
				}
				if got := p.PeekPartial(par, q, false); got != want {
					t.Fatalf("iter %d: PeekPartial(%v) = %d, reference %d", iter, q, got, want)
				}
			}
			checkConsistent(t, p)
		}
		p.Release(held...)
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

func reversed(ids []BlockID) []BlockID {
	r := slices.Clone(ids)
	slices.Reverse(r)
	return r
}

// TestTakePartial: partial reuse in place takes only blocks nobody holds,
// out of both indexes, as an eviction (recorded), and pins them.
func TestTakePartial(t *testing.T) {
	p := newTestPool(t, 4)
	p.TrackEvictions(true)
	ids, _ := p.Allocate(2)
	a, b := []int32{1, 2, 3, 4}, []int32{1, 2, 3, 9}
	ha, _, _ := p.CommitTokens(ids[0], Hash{}, a)
	hb, _, _ := p.CommitTokens(ids[1], Hash{}, b)
	// Both held: nothing to take, though both match.
	if _, _, _, ok := p.TakePartial(Hash{}, []int32{1, 2, 3}); ok {
		t.Fatal("took a block someone holds")
	}
	if _, ok := p.TakeCached(ha); ok {
		t.Fatal("TakeCached took a pinned block")
	}
	if got := p.PeekPartial(Hash{}, []int32{1, 2, 3}, true); got != 0 {
		t.Fatalf("PeekPartial(unused) with every block held = %d, want 0", got)
	}
	p.Release(ids[1]) // b is cached now, a still held
	id, h, n, ok := p.TakePartial(Hash{}, []int32{1, 2, 3})
	if !ok || id != ids[1] || h != hb || n != 3 {
		t.Fatalf("TakePartial = %d %v %d %v, want block %d (%v), 3 tokens", id, h, n, ok, ids[1], hb)
	}
	if _, ok := p.Lookup(hb); ok {
		t.Fatal("a taken block is still indexed")
	}
	if got := p.PeekPartial(Hash{}, []int32{1, 2, 3, 9}, false); got != 3 {
		t.Fatalf("after the take, PeekPartial = %d, want 3 (block a only)", got)
	}
	if ev, _ := p.DrainEvicted(nil); !slices.Equal(ev, []Hash{hb}) {
		t.Fatalf("evictions recorded %v, want the taken %v", ev, hb)
	}
	checkConsistent(t, p)
	// Released, the taken block is free, not cached.
	p.Release(id)
	if st := p.Stats(); st.Cached != 0 || st.Free != 3 || st.Pinned != 1 {
		t.Fatalf("after releasing the taken block: %+v", st)
	}
	p.Release(ids[0])
	got, ok := p.TakeCached(ha)
	if !ok || got != ids[0] {
		t.Fatalf("TakeCached(a) = %d %v, want %d", got, ok, ids[0])
	}
	p.Release(got)
	checkConsistent(t, p)
}

// TestPartialTakeProperty drives the partial-reuse calls (MatchPartial,
// TakePartial, TakeCached) interleaved with allocation, commits and
// releases against a naive reference: the committed blocks with their
// parent, tokens and holders. Every block allocated gets a fresh stamp in
// its memory, as a request's writes would, so a block found after it was
// evicted and rewritten shows. It checks that a match finds the reference's
// longest match, and a block that holds the stamp of the tokens it matched;
// that a take finds only blocks nobody holds, and that nothing finds a
// taken block again; and the counts.
func TestPartialTakeProperty(t *testing.T) {
	const nb, tpb = 12, 4
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 3))
		p := newTestPool(t, nb)
		p.TrackEvictions(true)
		type entry struct {
			parent Hash
			toks   []int32
			id     BlockID
			stamp  uint64
		}
		live := map[Hash]entry{} // committed blocks, by hash
		refs := map[BlockID]int{}
		stamps := map[BlockID]uint64{} // the stamp each pinned block was given
		var held []BlockID             // one entry per reference
		next := uint64(0)
		parents := []Hash{{}, RootHash("tenant"), BlockHash(Hash{}, []int32{0, 0, 0, 0})}
		stampOf := func(id BlockID) uint64 { return binary.LittleEndian.Uint64(p.Block(id)) }
		forgetEvicted := func() {
			ev, lost := p.DrainEvicted(nil)
			if lost {
				t.Fatalf("seed %d: eviction record lost", seed)
			}
			for _, h := range ev {
				delete(live, h)
			}
		}
		pin := func(id BlockID) { refs[id]++; held = append(held, id) }
		best := func(par Hash, q []int32, unused bool) int {
			want := 0
			for _, e := range live {
				if e.parent != par || unused && refs[e.id] > 0 {
					continue
				}
				k := 0
				for k < len(q) && k < tpb && e.toks[k] == q[k] {
					k++
				}
				want = max(want, k)
			}
			return want
		}
		// found checks a block a match or take returned for q under par.
		found := func(op string, id BlockID, h Hash, n int, par Hash, q []int32) entry {
			e, ok := live[h]
			if !ok || e.id != id || e.parent != par || !slices.Equal(e.toks[:n], q[:n]) {
				t.Fatalf("seed %d: %s(%v) = block %d %v (%d tokens): not a committed block of that parent and tokens", seed, op, q, id, h, n)
			}
			if got := stampOf(id); got != e.stamp {
				t.Fatalf("seed %d: %s found block %d holding stamp %d, committed with %d: rewritten since", seed, op, id, got, e.stamp)
			}
			return e
		}
		for step := range 150 {
			par := parents[rng.IntN(len(parents))]
			q := make([]int32, 1+rng.IntN(tpb))
			for i := range q {
				q[i] = int32(rng.IntN(2))
			}
			switch rng.IntN(6) {
			case 0, 1: // a request's block: allocate, write, commit
				ids, err := p.Allocate(1)
				if err != nil {
					break
				}
				forgetEvicted()
				id := ids[0]
				if refs[id] != 0 {
					t.Fatalf("seed %d step %d: allocated block %d, which %d references hold", seed, step, id, refs[id])
				}
				next++
				binary.LittleEndian.PutUint64(p.Block(id), next)
				stamps[id] = next
				pin(id)
				toks := make([]int32, tpb)
				for i := range toks {
					toks[i] = int32(rng.IntN(2))
				}
				h, ok, err := p.CommitTokens(id, par, toks)
				if err != nil {
					t.Fatal(err)
				}
				if _, dup := live[h]; ok == dup {
					t.Fatalf("seed %d step %d: CommitTokens indexed %v, already indexed %v", seed, step, ok, dup)
				}
				if ok {
					live[h] = entry{par, toks, id, next}
				}
			case 2: // release one reference
				if len(held) == 0 {
					break
				}
				i := rng.IntN(len(held))
				id := held[i]
				if err := p.Release(id); err != nil {
					t.Fatal(err)
				}
				held = slices.Delete(held, i, i+1)
				refs[id]--
			case 3: // copy on partial reuse: match and pin, shared
				id, h, n, ok := p.MatchPartial(par, q)
				if want := best(par, q, false); n != want || ok != (want > 0) {
					t.Fatalf("seed %d step %d: MatchPartial(%v) = %d tokens (%v), reference %d", seed, step, q, n, ok, want)
				}
				if ok {
					found("MatchPartial", id, h, n, par, q)
					pin(id)
				}
			case 4: // partial reuse in place: take a block nobody holds
				want := best(par, q, true)
				id, h, n, ok := p.TakePartial(par, q)
				if n != want || ok != (want > 0) {
					t.Fatalf("seed %d step %d: TakePartial(%v) = %d tokens (%v), reference %d", seed, step, q, n, ok, want)
				}
				if ok {
					found("TakePartial", id, h, n, par, q)
					delete(live, h)
					forgetEvicted()
					pin(id)
				}
			case 5: // take a committed block by hash, as the other ranks do
				var hs []Hash
				for h := range live {
					hs = append(hs, h)
				}
				if len(hs) == 0 {
					break
				}
				slices.SortFunc(hs, func(a, b Hash) int { return slices.Compare(a[:], b[:]) })
				h := hs[rng.IntN(len(hs))]
				e := live[h]
				id, ok := p.TakeCached(h)
				if ok != (refs[e.id] == 0) {
					t.Fatalf("seed %d step %d: TakeCached of block %d held by %d = %v", seed, step, e.id, refs[e.id], ok)
				}
				if ok {
					found("TakeCached", id, h, tpb, e.parent, e.toks)
					delete(live, h)
					forgetEvicted()
					pin(id)
				}
			}
			for h := range live {
				if p.PeekPrefix([]Hash{h}) != 1 {
					t.Fatalf("seed %d step %d: the reference's block %v is not indexed", seed, step, h)
				}
			}
			st := p.Stats()
			if st.Indexed != len(live) || st.Pinned != countPinned(refs) {
				t.Fatalf("seed %d step %d: %+v, reference %d indexed, %d pinned", seed, step, st, len(live), countPinned(refs))
			}
			checkConsistent(t, p)
		}
		if err := p.Release(held...); err != nil {
			t.Fatal(err)
		}
		if st := p.Stats(); st.Pinned != 0 || st.Available() != nb {
			t.Fatalf("seed %d: after releasing everything: %+v", seed, st)
		}
	}
}

// countPinned counts the blocks with references.
func countPinned(refs map[BlockID]int) int {
	n := 0
	for _, r := range refs {
		if r > 0 {
			n++
		}
	}
	return n
}
