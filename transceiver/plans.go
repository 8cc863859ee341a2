package transceiver

import (
	"sync"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// planMemo remembers what the checks of a transfer work out from a pair of
// cache states, so that a rank works it out once per peer state rather
// than once per request: the decoding of a peer's state from the wire,
// the encoding of the rank's own, layout.Compatible, layout.TargetRanks
// and layout.NewPlan. All are pure functions of their arguments; the memo
// gives the result (error included) the function gave for the same
// arguments, so a core that asks it stays a function of its events. Its
// lock is a leaf: it is taken under rank.mu (the send core's checks) and
// alone (a receive core's), and nothing is called with it held (the
// functions run outside it; two callers may both compute a result).
//
// A memo holds at most maxMemoEntries results of each kind and forgets
// them all when one more comes (a peer could send a new state with every
// ask; honest instances have a handful). A nil *planMemo computes each
// time. What it returns is shared: callers must not modify the slices.
type planMemo struct {
	mu      sync.Mutex
	states  map[string]stateResult
	compat  map[statePair]error
	targets map[rankPair]targetsResult
	plans   map[rankPair]planResult
	encoded map[stateKey]stateBytes
}

type stateBytes struct {
	b   []byte
	err error
}

// stateKey is a layout.CacheState as a map key: the state's fields, with
// up to maxKeyStages stages of LayersPerPP (a state with more is not
// memoized).
type stateKey struct {
	shape          kvcache.Shape
	tp, pp, cp     int
	dpRank, dpSize int
	attentionDP    bool
	attention      layout.AttentionType
	blockReuse     bool
	stages         int
	layersPerPP    [maxKeyStages]int
}

const maxKeyStages = 8

// keyOf returns s's key, and false when s cannot have one.
func keyOf(s layout.CacheState) (stateKey, bool) {
	p := s.Parallel
	if len(p.LayersPerPP) > maxKeyStages {
		return stateKey{}, false
	}
	k := stateKey{shape: s.Shape, tp: p.TP, pp: p.PP, cp: p.CP, dpRank: p.DPRank, dpSize: p.DPSize,
		attentionDP: p.AttentionDP, attention: s.Attention, blockReuse: s.BlockReuse, stages: len(p.LayersPerPP)}
	copy(k.layersPerPP[:], p.LayersPerPP)
	return k, true
}

// maxMemoEntries bounds each map of a planMemo.
const maxMemoEntries = 256

type statePair struct{ a, b stateKey }

type rankPair struct {
	a, b         stateKey
	aRank, bRank int
}

// pairKey returns the key of states a and b with ranks ar and br, and
// false when either state cannot have one.
func pairKey(a layout.CacheState, ar int, b layout.CacheState, br int) (rankPair, bool) {
	ka, oka := keyOf(a)
	kb, okb := keyOf(b)
	return rankPair{ka, kb, ar, br}, oka && okb
}

type stateResult struct {
	state layout.CacheState
	err   error
}

type targetsResult struct {
	ranks []int
	err   error
}

type planResult struct {
	plan *layout.Plan
	err  error
}

func newPlanMemo() *planMemo {
	return &planMemo{states: map[string]stateResult{}, compat: map[statePair]error{},
		targets: map[rankPair]targetsResult{}, plans: map[rankPair]planResult{}, encoded: map[stateKey]stateBytes{}}
}

// memo returns m[k], computing it with f (outside the memo's lock) when m
// does not hold it.
func memo[K comparable, V any](mu *sync.Mutex, m map[K]V, k K, f func() V) V {
	mu.Lock()
	v, ok := m[k]
	mu.Unlock()
	if ok {
		return v
	}
	v = f()
	mu.Lock()
	if len(m) >= maxMemoEntries {
		clear(m)
	}
	m[k] = v
	mu.Unlock()
	return v
}

// state decodes a cache state from its wire form.
func (p *planMemo) state(b []byte) (layout.CacheState, error) {
	decode := func() stateResult {
		var s layout.CacheState
		err := s.UnmarshalBinary(b)
		return stateResult{s, err}
	}
	if p == nil {
		r := decode()
		return r.state, r.err
	}
	p.mu.Lock()
	r, ok := p.states[string(b)] // (no allocation for the lookup)
	p.mu.Unlock()
	if !ok {
		r = memo(&p.mu, p.states, string(b), decode)
	}
	return r.state, r.err
}

// encode is s.MarshalBinary() (the bytes are shared: read-only).
func (p *planMemo) encode(s layout.CacheState) ([]byte, error) {
	f := func() stateBytes {
		b, err := s.MarshalBinary()
		return stateBytes{b, err}
	}
	k, ok := keyOf(s)
	if p == nil || !ok {
		r := f()
		return r.b, r.err
	}
	r := memo(&p.mu, p.encoded, k, f)
	return r.b, r.err
}

// compatible is layout.Compatible(prefill, gen).
func (p *planMemo) compatible(prefill, gen layout.CacheState) error {
	f := func() error { return layout.Compatible(prefill, gen) }
	k, ok := pairKey(prefill, 0, gen, 0)
	if p == nil || !ok {
		return f()
	}
	return memo(&p.mu, p.compat, statePair{k.a, k.b}, f)
}

// targetRanks is layout.TargetRanks(peer, self, selfRank).
func (p *planMemo) targetRanks(peer, self layout.CacheState, selfRank int) ([]int, error) {
	f := func() targetsResult {
		r, err := layout.TargetRanks(peer, self, selfRank)
		return targetsResult{r, err}
	}
	k, ok := pairKey(peer, 0, self, selfRank)
	if p == nil || !ok {
		r := f()
		return r.ranks, r.err
	}
	r := memo(&p.mu, p.targets, k, f)
	return r.ranks, r.err
}

// plan is layout.NewPlan(prefill, prefillRank, gen, genRank).
func (p *planMemo) plan(prefill layout.CacheState, prefillRank int, gen layout.CacheState, genRank int) (*layout.Plan, error) {
	f := func() planResult {
		pl, err := layout.NewPlan(prefill, prefillRank, gen, genRank)
		return planResult{pl, err}
	}
	k, ok := pairKey(prefill, prefillRank, gen, genRank)
	if p == nil || !ok {
		r := f()
		return r.plan, r.err
	}
	r := memo(&p.mu, p.plans, k, f)
	return r.plan, r.err
}
