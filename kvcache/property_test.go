package kvcache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// model is a naive reference for Pool: maps and slices, no cleverness. It
// does not predict which free block Allocate picks, only which blocks it may
// pick and which cached blocks it must evict.
type model struct {
	total  int
	refs   map[BlockID]int  // pinned blocks
	free   map[BlockID]bool // clean free blocks
	lru    []BlockID        // cached blocks, least recently released first
	index  map[Hash]BlockID
	hashOf map[BlockID]Hash // committed blocks, pinned or cached
	stamp  map[BlockID]uint64
}

func newModel(n int) *model {
	m := &model{total: n, refs: map[BlockID]int{}, free: map[BlockID]bool{}, index: map[Hash]BlockID{},
		hashOf: map[BlockID]Hash{}, stamp: map[BlockID]uint64{}}
	for i := range n {
		m.free[BlockID(i)] = true
	}
	return m
}

func (m *model) release(id BlockID) {
	m.refs[id]--
	if m.refs[id] > 0 {
		return
	}
	delete(m.refs, id)
	if _, ok := m.hashOf[id]; ok {
		m.lru = append(m.lru, id)
	} else {
		m.free[id] = true
	}
}

func (m *model) pin(id BlockID) {
	if i := slices.Index(m.lru, id); i >= 0 {
		m.lru = slices.Delete(m.lru, i, i+1)
	}
	m.refs[id]++
}

func (m *model) stats() (free, cached, pinned int) { return len(m.free), len(m.lru), len(m.refs) }

// pinnedIDs returns the pinned blocks, one entry per reference, sorted.
func (m *model) pinnedRefs() []BlockID {
	var ids []BlockID
	for id, n := range m.refs {
		for range n {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

func TestPoolAgainstModel(t *testing.T) {
	seeds := 200
	if testing.Short() {
		seeds = 20
	}
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			runModel(t, seed, 400)
		})
	}
}

func runModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 0x6b76786665720a))
	n := 1 + rng.IntN(12)
	p := newTestPool(t, n)
	m := newModel(n)
	hashes := make([]Hash, 1+rng.IntN(2*n))
	for i := range hashes {
		hashes[i] = hashN(i)
	}
	var nextStamp uint64
	readStamp := func(id BlockID) uint64 { return binary.LittleEndian.Uint64(p.Block(id)) }
	randomPinned := func() (BlockID, bool) {
		refs := m.pinnedRefs()
		if len(refs) == 0 {
			return 0, false
		}
		return refs[rng.IntN(len(refs))], true
	}
	unpinned := func() (BlockID, bool) {
		for id := range BlockID(n) {
			if m.refs[id] == 0 {
				return id, true
			}
		}
		return 0, false
	}

	for step := range steps {
		var op string
		switch r := rng.IntN(100); {
		case r < 25:
			k := rng.IntN(4)
			op = fmt.Sprintf("Allocate(%d)", k)
			before := p.Stats()
			ids, err := p.Allocate(k)
			if free, cached, _ := m.stats(); k > free+cached {
				if !errors.Is(err, ErrPoolExhausted) || p.Stats() != before {
					t.Fatalf("step %d %s: %v, %v; want ErrPoolExhausted and no change", step, op, ids, err)
				}
				break
			}
			if err != nil || len(ids) != k {
				t.Fatalf("step %d %s = %v, %v", step, op, ids, err)
			}
			// Clean blocks first, then exactly the oldest cached blocks.
			fromFree := min(k, len(m.free))
			evict := m.lru[:k-fromFree]
			var gotEvicted []BlockID
			for _, id := range ids {
				switch {
				case m.refs[id] > 0:
					t.Fatalf("step %d %s: block %d handed out while pinned", step, op, id)
				case m.free[id]:
					delete(m.free, id)
				case slices.Contains(m.lru, id):
					gotEvicted = append(gotEvicted, id)
				default:
					t.Fatalf("step %d %s: block %d handed out twice", step, op, id)
				}
				m.refs[id] = 1
			}
			if !slices.Equal(gotEvicted, evict) {
				t.Fatalf("step %d %s: evicted %v, want %v (least recently released first)", step, op, gotEvicted, evict)
			}
			m.lru = slices.Clone(m.lru[len(evict):])
			for _, id := range evict {
				delete(m.index, m.hashOf[id])
				delete(m.hashOf, id)
			}
			for _, id := range ids {
				nextStamp++
				binary.LittleEndian.PutUint64(p.Block(id), nextStamp)
				m.stamp[id] = nextStamp
			}
		case r < 35:
			id, ok := randomPinned()
			if !ok {
				continue
			}
			op = fmt.Sprintf("Retain(%d)", id)
			if err := p.Retain(id); err != nil {
				t.Fatalf("step %d %s: %v", step, op, err)
			}
			m.refs[id]++
		case r < 60:
			// Release one to three references, possibly of the same block.
			refs := m.pinnedRefs()
			rng.Shuffle(len(refs), func(i, j int) { refs[i], refs[j] = refs[j], refs[i] })
			rel := refs[:min(len(refs), 1+rng.IntN(3))]
			op = fmt.Sprintf("Release(%v)", rel)
			if err := p.Release(rel...); err != nil {
				t.Fatalf("step %d %s: %v", step, op, err)
			}
			for _, id := range rel {
				m.release(id)
			}
		case r < 75:
			id, ok := randomPinned()
			if !ok {
				continue
			}
			h := hashes[rng.IntN(len(hashes))]
			if old, committed := m.hashOf[id]; committed && old != h && invariants {
				continue // would panic
			}
			op = fmt.Sprintf("Commit(%d, %v)", id, h)
			got, err := p.Commit(id, h)
			old, committed := m.hashOf[id]
			_, taken := m.index[h]
			switch {
			case committed && old != h:
				if !errors.Is(err, ErrCommitted) {
					t.Fatalf("step %d %s: %v, want ErrCommitted", step, op, err)
				}
			case committed:
				if !got || err != nil {
					t.Fatalf("step %d %s = %v, %v; want true (already)", step, op, got, err)
				}
			case taken:
				if got || err != nil {
					t.Fatalf("step %d %s = %v, %v; want false (hash taken)", step, op, got, err)
				}
			default:
				if !got || err != nil {
					t.Fatalf("step %d %s = %v, %v; want true", step, op, got, err)
				}
				m.index[h] = id
				m.hashOf[id] = h
			}
		case r < 85:
			h := hashes[rng.IntN(len(hashes))]
			op = fmt.Sprintf("Lookup(%v)", h)
			id, ok := p.Lookup(h)
			want, wantOK := m.index[h]
			if ok != wantOK || ok && id != want {
				t.Fatalf("step %d %s = %d, %v; want %d, %v", step, op, id, ok, want, wantOK)
			}
			if ok {
				m.pin(id)
				if got := readStamp(id); got != m.stamp[id] {
					t.Fatalf("step %d %s: block %d holds stamp %d, want %d: reallocated?", step, op, id, got, m.stamp[id])
				}
			}
		case r < 92:
			hs := make([]Hash, rng.IntN(4))
			for i := range hs {
				hs[i] = hashes[rng.IntN(len(hashes))]
			}
			op = fmt.Sprintf("MatchPrefix(%v)", hs)
			got := p.MatchPrefix(hs)
			var want []BlockID
			for _, h := range hs {
				id, ok := m.index[h]
				if !ok {
					break
				}
				want = append(want, id)
				m.pin(id)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("step %d %s = %v, want %v", step, op, got, want)
			}
		default:
			if invariants {
				continue
			}
			// Misuse must fail and change nothing.
			id, ok := unpinned()
			if !ok {
				continue
			}
			op = fmt.Sprintf("misuse of unpinned %d", id)
			before := p.Stats()
			if err := p.Release(id); !errors.Is(err, ErrDoubleFree) {
				t.Fatalf("step %d Release(%d) of an unpinned block = %v", step, id, err)
			}
			if err := p.Retain(id); !errors.Is(err, ErrBadBlock) {
				t.Fatalf("step %d Retain(%d) of an unpinned block = %v", step, id, err)
			}
			if p.Block(id) != nil {
				t.Fatalf("step %d Block(%d) of an unpinned block is not nil", step, id)
			}
			if p.Stats() != before {
				t.Fatalf("step %d %s changed the pool", step, op)
			}
		}

		s := p.Stats()
		free, cached, pinned := m.stats()
		if s.Free != free || s.Cached != cached || s.Pinned != pinned || s.Indexed != len(m.index) ||
			s.Free+s.Cached+s.Pinned != s.Total || p.FreeBlocks() != free+cached {
			t.Fatalf("step %d after %s: stats %+v, model free %d cached %d pinned %d indexed %d",
				step, op, s, free, cached, pinned, len(m.index))
		}
		for id, refs := range m.refs {
			if got := int(p.refs[id].Load()); got != refs {
				t.Fatalf("step %d after %s: block %d refcount %d, want %d", step, op, id, got, refs)
			}
		}
		checkConsistent(t, p)
	}

	// Leak check: give every reference back; every block is available.
	if err := p.Release(m.pinnedRefs()...); err != nil {
		t.Fatal(err)
	}
	if s := p.Stats(); s.Pinned != 0 || s.Available() != n {
		t.Fatalf("after releasing everything: %+v", s)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
}
