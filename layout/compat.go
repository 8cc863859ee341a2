package layout

import (
	"errors"
	"strings"
)

// ErrIncompatible is matched (errors.Is) by every *IncompatibleError.
var ErrIncompatible = errors.New("layout: incompatible cache states")

// Mismatch is one reason two cache states cannot exchange KV: a field that
// differs between the sides, or a field that makes one side's layout
// impossible (then Reason says which side and why).
type Mismatch struct {
	// Field is the config/wire name of the field ("dtype", "kv_heads", "cp").
	Field string
	// Ctx and Gen are the field's printed values on each side.
	Ctx, Gen string
	// Reason is empty when the values simply differ; otherwise it starts
	// with the side(s) at fault: "ctx: ...", "gen: ..." or "ctx and gen: ...".
	Reason string
}

// String returns "field: ctx=X gen=Y" followed by " (reason)" when there is one.
func (m Mismatch) String() string {
	s := m.Field + ": ctx=" + m.Ctx + " gen=" + m.Gen
	if m.Reason != "" {
		s += " (" + m.Reason + ")"
	}
	return s
}

// IncompatibleError is returned by Compatible (and by NewPlan) when a context
// state and a generation state cannot exchange KV. It lists every mismatch
// and keeps both states so that the message can print them in full.
type IncompatibleError struct {
	Ctx, Gen   CacheState
	Mismatches []Mismatch
}

// Error prints every mismatch and then every field of both states, on one
// line.
func (e *IncompatibleError) Error() string {
	var b strings.Builder
	b.WriteString(ErrIncompatible.Error())
	b.WriteString(": ")
	for i, m := range e.Mismatches {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(m.String())
	}
	b.WriteString(" [ctx: ")
	b.WriteString(e.Ctx.String())
	b.WriteString("] [gen: ")
	b.WriteString(e.Gen.String())
	b.WriteString("]")
	return b.String()
}

// Is reports whether target is ErrIncompatible.
func (e *IncompatibleError) Is(target error) bool { return target == ErrIncompatible }

// shapeFields are the fields that must be equal on both sides, in the order
// they are reported.
var shapeFields = []string{"layers", "kv_heads", "head_dim", "tokens_per_block", "kv_factor", "dtype", "attention"}

// Compatible reports whether KV computed under the context state prefill can be
// transferred into the generation state gen. It returns nil or an
// *IncompatibleError listing every problem at once: fields that must match
// but differ (layers, kv_heads, head_dim, tokens_per_block, kv_factor, dtype,
// attention) and anything that makes either side's layout impossible (heads
// that do not divide over TP, cp > 1, layers_per_pp not summing to layers,
// values out of range). Parallel layouts may otherwise differ freely: that is
// what TargetRanks and NewPlan are for. BlockReuse need not match.
func Compatible(prefill, gen CacheState) error {
	var ms []Mismatch
	for _, f := range shapeFields {
		c, g := fieldValue(prefill, f), fieldValue(gen, f)
		if c != g {
			ms = append(ms, Mismatch{Field: f, Ctx: c, Gen: g})
		}
	}
	// A problem of one side is attached to the plain difference of the same
	// field when there is one, and merged with the same problem of the other
	// side, so that each fact is printed once.
	addProblem := func(side string, p problem) {
		for i := range ms {
			m := &ms[i]
			if m.Field != p.field {
				continue
			}
			switch m.Reason {
			case "":
				m.Reason = side + ": " + p.reason
				return
			case "ctx: " + p.reason:
				m.Reason = "ctx and gen: " + p.reason
				return
			}
		}
		ms = append(ms, Mismatch{Field: p.field, Ctx: fieldValue(prefill, p.field), Gen: fieldValue(gen, p.field), Reason: side + ": " + p.reason})
	}
	for _, p := range prefill.problems() {
		addProblem("ctx", p)
	}
	for _, p := range gen.problems() {
		addProblem("gen", p)
	}
	if len(ms) == 0 {
		return nil
	}
	return &IncompatibleError{Ctx: prefill.clone(), Gen: gen.clone(), Mismatches: ms}
}
