package serving

import (
	"maps"
	"slices"
)

// HeldTokens returns the tokens whose KV a worker holds once it has
// served a turn: the prompt, then every answer token but the last (the
// last one is sampled and never fed back, so no KV of it exists). The
// result does not alias prompt or answer.
func HeldTokens(prompt, answer []int32) []int32 {
	held := slices.Clip(slices.Clone(prompt))
	if len(answer) > 0 {
		held = append(held, answer[:len(answer)-1]...)
	}
	return held
}

// Blocks returns the number of blocks of n tokens at tpb tokens per
// block (a partial last block counts).
func Blocks(n, tpb int) int {
	if n <= 0 || tpb <= 0 {
		return 0
	}
	return (n + tpb - 1) / tpb
}

// NewBlocks returns how many blocks of prompt a worker that holds the KV
// of held (HeldTokens of the conversation's previous turn; nil for a
// first turn) still has to compute or receive, at tpb tokens per block:
// the prompt's blocks less the full blocks of the longest common prefix
// of held and prompt. At most len(prompt)−1 tokens count as cached, as
// in TensorRT-LLM's block reuse (the last prompt token is always
// computed: it yields the first output token). This is the bench's own
// accounting, independent of what the server reports.
func NewBlocks(held, prompt []int32, tpb int) int {
	if tpb <= 0 || len(prompt) == 0 {
		return 0
	}
	common := 0
	for common < len(held) && common < len(prompt) && held[common] == prompt[common] {
		common++
	}
	common = min(common, len(prompt)-1)
	return Blocks(len(prompt), tpb) - common/tpb
}

// blockBytes returns the bytes of one block of r's KV over the ranks of
// the worker that received it, and whether the server reported it
// (kv_block_bytes) rather than the bench deriving it; 0 for a request
// that moved no KV or whose block size cannot be known. Derived, it is
// kv_transfer_bytes / kv_transfer_blocks, or, from a server that reports
// neither (today's), kv_transfer_bytes / the prompt's blocks when the
// answer also reports no cached prompt token: such a server moved every
// block of the prompt.
func blockBytes(r *Record) (int64, bool) {
	t := r.Timing
	switch {
	case t == nil || t.KVTransferBytes <= 0:
		return 0, false
	case t.KVBlockBytes > 0:
		return t.KVBlockBytes, true
	case t.KVTransferBlocks > 0:
		return t.KVTransferBytes / int64(t.KVTransferBlocks), false
	case r.PromptBlocks > 0 && (!r.HasCached || r.CachedTokens == 0):
		return t.KVTransferBytes / int64(r.PromptBlocks), false
	}
	return 0, false
}

// TurnMetrics are the reuse figures of one turn index over every
// conversation of a run (completed requests only).
type TurnMetrics struct {
	// Turn is the turn's index in its conversation, 0 first.
	Turn      int `json:"turn"`
	Completed int `json:"completed"`
	// PromptTokens and CachedTokens are summed over the turn's requests;
	// PrefixHitRate is their ratio over the requests whose answer
	// reported cached_tokens (null when none did).
	PromptTokens  int      `json:"prompt_tokens"`
	CachedTokens  int      `json:"cached_prompt_tokens"`
	PrefixHitRate *float64 `json:"prefix_hit_rate"`
	// KVBytes is the KV moved per request (kv_transfer_bytes; 0 for one
	// that moved none), over the requests that reported kvxfer_timing.
	KVBytes Dist `json:"kv_bytes"`
	// NewBlocks is the bench's count of new blocks per request (NewBlocks)
	// and NewBytes those times the block size (blockBytes), over the
	// requests whose block size is known.
	NewBlocks Dist `json:"new_blocks"`
	NewBytes  Dist `json:"new_block_bytes"`
	// MovedOverNew is the KV moved over the new blocks' bytes, summed over
	// the requests that moved KV and whose block size is known (null when
	// none): 1 when only the new blocks moved; the target is at most 1.1.
	MovedOverNew *float64 `json:"kv_moved_over_new"`
	TTFT         Dist     `json:"ttft_ms"`
}

// PathMetrics are a run's figures for one path class (PathHeader).
type PathMetrics struct {
	Path      string `json:"path"`
	Completed int    `json:"completed"`
	TTFT      Dist   `json:"ttft_ms"`
	KVBytes   Dist   `json:"kv_bytes"`
}

// reuseAcc accumulates reuse figures over a set of requests.
type reuseAcc struct {
	n, prompt, cached, reported, inferred int
	promptReported                        int
	moved, newBytes                       int64 // over the requests with a known block size
	kv, blocks, nb, ttft                  []float64
}

// add counts r, whose block size is bb (0: unknown) and derived by the
// bench rather than reported when inferred.
func (a *reuseAcc) add(r *Record, bb int64, inferred bool) {
	a.n++
	a.prompt += r.PromptTokens
	if r.HasCached {
		a.reported++
		a.cached += r.CachedTokens
		a.promptReported += r.PromptTokens
	}
	a.ttft = append(a.ttft, ms(r.TTFT))
	if r.Timing != nil {
		a.kv = append(a.kv, float64(r.Timing.KVTransferBytes))
	}
	if bb > 0 && r.PromptBlocks > 0 {
		if inferred {
			a.inferred++
		}
		nb := int64(r.NewBlocks) * bb
		a.blocks = append(a.blocks, float64(r.NewBlocks))
		a.nb = append(a.nb, float64(nb))
		if r.Timing != nil && r.Timing.KVTransferBytes > 0 { // the ratio is the transfers'
			a.moved += r.Timing.KVTransferBytes
			a.newBytes += nb
		}
	}
}

func (a *reuseAcc) hitRate() *float64 {
	if a.reported == 0 || a.promptReported == 0 {
		return nil
	}
	v := float64(a.cached) / float64(a.promptReported)
	return &v
}

func (a *reuseAcc) movedOverNew() *float64 {
	if a.newBytes == 0 {
		return nil
	}
	v := float64(a.moved) / float64(a.newBytes)
	return &v
}

// computeReuse fills m's reuse figures from the completed records. A
// request whose own block size is unknown (one that moved no KV: it ran
// locally, or its whole prompt was cached) counts its new blocks at the
// run's block size: the median of the others' (blockBytes).
func computeReuse(m *Metrics, records []Record) {
	var sizes []int64
	for i := range records {
		if bb, _ := blockBytes(&records[i]); bb > 0 && records[i].OK() {
			sizes = append(sizes, bb)
		}
	}
	var runBB int64
	if len(sizes) > 0 {
		slices.Sort(sizes)
		runBB = sizes[len(sizes)/2]
	}
	var all reuseAcc
	var turns []*reuseAcc
	paths := map[string]*reuseAcc{}
	seenHeader := false
	for i := range records {
		r := &records[i]
		if !r.OK() {
			continue
		}
		bb, reported := blockBytes(r)
		inferred := bb > 0 && !reported
		if bb == 0 {
			bb = runBB
		}
		all.add(r, bb, inferred)
		for len(turns) <= r.Turn {
			turns = append(turns, &reuseAcc{})
		}
		turns[r.Turn].add(r, bb, inferred)
		p := r.Path
		if p != "" {
			seenHeader = true
		} else {
			p = PathUnknown
		}
		if paths[p] == nil {
			paths[p] = &reuseAcc{}
		}
		paths[p].add(r, bb, inferred)
	}
	m.CachedTokens, m.CachedReported = all.cached, all.reported
	m.PrefixHitRate, m.MovedOverNew, m.BlockBytesInferred = all.hitRate(), all.movedOverNew(), all.inferred
	m.NewBlockBytes = Summarize(all.nb)
	m.PerTurn = []TurnMetrics{}
	for t, a := range turns {
		if a.n == 0 {
			continue
		}
		m.PerTurn = append(m.PerTurn, TurnMetrics{Turn: t, Completed: a.n, PromptTokens: a.prompt, CachedTokens: a.cached,
			PrefixHitRate: a.hitRate(), KVBytes: Summarize(a.kv), NewBlocks: Summarize(a.blocks), NewBytes: Summarize(a.nb),
			MovedOverNew: a.movedOverNew(), TTFT: Summarize(a.ttft)})
	}
	m.ByPath = []PathMetrics{}
	if !seenHeader {
		return
	}
	for _, p := range slices.Sorted(maps.Keys(paths)) {
		a := paths[p]
		m.ByPath = append(m.ByPath, PathMetrics{Path: p, Completed: a.n, TTFT: Summarize(a.ttft), KVBytes: Summarize(a.kv)})
	}
}
