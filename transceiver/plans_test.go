package transceiver

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// memoStates are states whose pairs cover compatible and incompatible
// pairings, several TP and PP sizes, uneven stages, MLA and a state with
// more stages than a key holds.
func memoStates() []layout.CacheState {
	var out []layout.CacheState
	for _, tp := range []int{1, 2, 4} {
		for _, pp := range []int{1, 2} {
			out = append(out, state(8, 4, 32, 32, kvcache.BF16, tp, pp, false))
		}
	}
	uneven := state(8, 4, 32, 32, kvcache.BF16, 1, 2, false)
	uneven.Parallel.LayersPerPP = []int{5, 3}
	many := state(16, 4, 32, 32, kvcache.BF16, 1, 16, false) // 16 stages: not memoized
	many.Parallel.LayersPerPP = []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}
	return append(out, uneven, many,
		state(8, 4, 32, 32, kvcache.FP16, 1, 1, false), // another dtype: incompatible with the rest
		state(8, 1, 64, 32, kvcache.BF16, 1, 1, true),
		state(8, 1, 64, 32, kvcache.BF16, 2, 1, true))
}

// TestPlanMemo: a memo gives what the layout functions give, results and
// errors, the first time and from memory, for every pair of states and
// ranks.
func TestPlanMemo(t *testing.T) {
	states := memoStates()
	m := newPlanMemo()
	for round := range 2 {
		for i, a := range states {
			for j, b := range states {
				name := fmt.Sprintf("round %d: state %d -> %d", round, i, j)
				if got, want := m.compatible(a, b), layout.Compatible(a, b); !sameErr(got, want) {
					t.Fatalf("%s: compatible: %v, want %v", name, got, want)
				}
				for br := range b.Parallel.NumRanks() {
					got, gerr := m.targetRanks(a, b, br)
					want, werr := layout.TargetRanks(a, b, br)
					if !sameErr(gerr, werr) || !reflect.DeepEqual(got, want) {
						t.Fatalf("%s, rank %d: targets %v %v, want %v %v", name, br, got, gerr, want, werr)
					}
					for ar := range a.Parallel.NumRanks() {
						got, gerr := m.plan(a, ar, b, br)
						want, werr := layout.NewPlan(a, ar, b, br)
						if !sameErr(gerr, werr) || !reflect.DeepEqual(got, want) {
							t.Fatalf("%s, ranks %d -> %d: plan %+v %v, want %+v %v", name, ar, br, got, gerr, want, werr)
						}
					}
				}
			}
		}
		for i, s := range states {
			b, err := s.MarshalBinary()
			if err != nil {
				t.Fatal(err)
			}
			if got, err := m.encode(s); err != nil || !slices.Equal(got, b) {
				t.Fatalf("round %d: state %d encoded % x %v, want % x", round, i, got, err, b)
			}
			for _, in := range [][]byte{b, b[:len(b)-1], nil, append(b, 0)} {
				got, gerr := m.state(in)
				var want layout.CacheState
				werr := want.UnmarshalBinary(in)
				if werr != nil {
					want = layout.CacheState{}
				}
				if !sameErr(gerr, werr) || !reflect.DeepEqual(got, want) {
					t.Fatalf("round %d: state %d from % x: %+v %v, want %+v %v", round, i, in, got, gerr, want, werr)
				}
			}
		}
	}
	var nilMemo *planMemo
	a := states[0]
	if _, err := nilMemo.plan(a, 0, a, 0); err != nil {
		t.Fatalf("nil memo: %v", err)
	}
}

// TestPlanMemoBounded: a memo holds at most maxMemoEntries results of a
// kind, however many distinct states come.
func TestPlanMemoBounded(t *testing.T) {
	m := newPlanMemo()
	self := state(8, 4, 32, 32, kvcache.BF16, 1, 1, false)
	for i := range 3 * maxMemoEntries {
		peer := state(8, 4, 32, 32+i, kvcache.BF16, 1, 1, false)
		m.compatible(peer, self)
		b, err := peer.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.state(b); err != nil {
			t.Fatal(err)
		}
		if len(m.compat) > maxMemoEntries || len(m.states) > maxMemoEntries {
			t.Fatalf("after %d states: %d compat and %d states kept, want at most %d", i+1, len(m.compat), len(m.states), maxMemoEntries)
		}
	}
}

func sameErr(a, b error) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.Error() == b.Error() && reflect.TypeOf(a) == reflect.TypeOf(b) &&
		errors.Is(a, layout.ErrNotTarget) == errors.Is(b, layout.ErrNotTarget)
}

// TestPlanMemoKeyCoversState: changing any one field of a CacheState (its
// shape's, its parallel config's, its own) changes its memo key, so that a
// field added to the state later cannot make two states share a plan
// without this test failing.
func TestPlanMemoKeyCoversState(t *testing.T) {
	base := state(8, 4, 32, 32, kvcache.BF16, 2, 2, false)
	base.Parallel.LayersPerPP = []int{5, 3}
	k0, ok := keyOf(base)
	if !ok {
		t.Fatal("no key for the base state")
	}
	n := leafCount(reflect.ValueOf(base))
	if n < 15 {
		t.Fatalf("CacheState has %d leaf fields, expected at least 15", n)
	}
	for j := range n {
		s := base
		s.Parallel.LayersPerPP = slices.Clone(base.Parallel.LayersPerPP)
		v, name := leafField(reflect.ValueOf(&s).Elem(), "CacheState", j)
		switch v.Kind() {
		case reflect.Int:
			v.SetInt(v.Int() + 1)
		case reflect.Uint8:
			v.SetUint(v.Uint() + 1)
		case reflect.Bool:
			v.SetBool(!v.Bool())
		case reflect.Slice:
			v.Index(0).SetInt(v.Index(0).Int() + 1)
		default:
			t.Fatalf("%s is a %s: teach this test (and keyOf) about it", name, v.Kind())
		}
		if k, ok := keyOf(s); !ok || k == k0 {
			t.Errorf("%s changed, the memo key did not", name)
		}
	}
}

// leafCount counts the fields under v that are not structs (v itself when
// it is not one).
func leafCount(v reflect.Value) int {
	if v.Kind() != reflect.Struct {
		return 1
	}
	n := 0
	for i := range v.NumField() {
		n += leafCount(v.Field(i))
	}
	return n
}

// leafField returns the j-th of those fields, in field order, and its path
// from name.
func leafField(v reflect.Value, name string, j int) (reflect.Value, string) {
	if v.Kind() != reflect.Struct {
		return v, name
	}
	for i := range v.NumField() {
		f := v.Field(i)
		if c := leafCount(f); j >= c {
			j -= c
			continue
		}
		return leafField(f, name+"."+v.Type().Field(i).Name, j)
	}
	panic("transceiver: leafField past the last field")
}
