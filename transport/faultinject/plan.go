package faultinject

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Op is an operation of transport.Transport that a rule can hit.
type Op int

// The operations.
const (
	OpSend Op = iota
	OpExpect
	numOps
)

func (o Op) String() string {
	switch o {
	case OpSend:
		return "send"
	case OpExpect:
		return "expect"
	}
	return "op(" + strconv.Itoa(int(o)) + ")"
}

// Kind is a fault.
type Kind int

// The fault kinds (see the package documentation).
const (
	Fail Kind = iota
	Delay
	Truncate
	Reorder
	numKinds
)

func (k Kind) String() string {
	switch k {
	case Fail:
		return "fail"
	case Delay:
		return "delay"
	case Truncate:
		return "truncate"
	case Reorder:
		return "reorder"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Rule hits every Every-th operation Op with fault Kind. Duration is the
// delay (Delay, default 20 ms) or the longest hold (Reorder, default
// 50 ms).
type Rule struct {
	Op       Op
	Kind     Kind
	Every    int
	Duration time.Duration
}

// Plan is a set of rules and the seed that places them. The first rule
// that hits an operation applies; the others do not.
type Plan struct {
	Seed  uint64
	Rules []Rule
}

// EnvPlan is the environment variable FromEnv reads a plan from (kvxfer
// built with -tags chaos: its worker's data planes).
const EnvPlan = "KVXFER_FAULTS"

// Default durations.
const (
	DefaultDelay = 20 * time.Millisecond
	DefaultHold  = 50 * time.Millisecond
)

// ParsePlan parses a plan: items separated by ";" or ",", each either
// "seed=N" or "OP:KIND/EVERY[=DURATION]", e.g.
//
//	seed=7;send:fail/5;expect:truncate/9;send:delay/3=20ms;send:reorder/4
//
// OP is send or expect; KIND is fail, delay, truncate or reorder; EVERY is
// at least 1. The empty string is the plan without faults.
func ParsePlan(s string) (Plan, error) {
	var p Plan
	for item := range strings.FieldsFuncSeq(s, func(r rune) bool { return r == ';' || r == ',' }) {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		if v, ok := strings.CutPrefix(item, "seed="); ok {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return Plan{}, fmt.Errorf("faultinject: %q: seed: %v", item, err)
			}
			p.Seed = n
			continue
		}
		r, err := parseRule(item)
		if err != nil {
			return Plan{}, err
		}
		p.Rules = append(p.Rules, r)
	}
	return p, nil
}

func parseRule(item string) (Rule, error) {
	bad := func(why string) (Rule, error) {
		return Rule{}, fmt.Errorf("faultinject: %q: %s (want OP:KIND/EVERY[=DURATION], e.g. send:fail/5)", item, why)
	}
	op, rest, ok := strings.Cut(item, ":")
	if !ok {
		return bad("no ':'")
	}
	kind, rest, ok := strings.Cut(rest, "/")
	if !ok {
		return bad("no '/'")
	}
	every, dur, hasDur := strings.Cut(rest, "=")
	var r Rule
	switch strings.TrimSpace(op) {
	case "send":
		r.Op = OpSend
	case "expect":
		r.Op = OpExpect
	default:
		return bad("operation " + strconv.Quote(op) + " is not send or expect")
	}
	found := false
	for k := range numKinds {
		if k.String() == strings.TrimSpace(kind) {
			r.Kind, found = k, true
		}
	}
	if !found {
		return bad("kind " + strconv.Quote(kind) + " is not fail, delay, truncate or reorder")
	}
	n, err := strconv.Atoi(strings.TrimSpace(every))
	if err != nil || n < 1 {
		return bad("every " + strconv.Quote(every) + " is not an integer >= 1")
	}
	r.Every = n
	if hasDur {
		d, err := time.ParseDuration(strings.TrimSpace(dur))
		if err != nil || d < 0 {
			return bad("duration " + strconv.Quote(dur) + " is not a duration >= 0")
		}
		r.Duration = d
	}
	return r, nil
}

// String is the plan in ParsePlan's form.
func (p Plan) String() string {
	items := []string{"seed=" + strconv.FormatUint(p.Seed, 10)}
	for _, r := range p.Rules {
		s := fmt.Sprintf("%s:%s/%d", r.Op, r.Kind, r.Every)
		if r.Duration > 0 {
			s += "=" + r.Duration.String()
		}
		items = append(items, s)
	}
	return strings.Join(items, ";")
}

// phase is where rule i's hits fall: operation n (1-based) is hit when
// (n + phase) % Every == 0. It is a function of the seed and the rule's
// index only (splitmix64), so a plan hits the same operations every run.
func (p Plan) phase(i int) uint64 {
	z := p.Seed + uint64(i+1)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	z ^= z >> 31
	return z % uint64(p.Rules[i].Every)
}

// Hit returns the rule that hits the n-th (1-based) operation op, if any.
func (p Plan) Hit(op Op, n uint64) (Rule, bool) {
	for i, r := range p.Rules {
		if r.Op == op && (n+p.phase(i))%uint64(r.Every) == 0 {
			return r, true
		}
	}
	return Rule{}, false
}
