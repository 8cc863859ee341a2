package serving

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
)

// ErrBadLengths: a length distribution that cannot be parsed or used.
var ErrBadLengths = errors.New("serving: bad length distribution")

// LengthKind is the shape of a Lengths distribution.
type LengthKind string

// The kinds of Lengths.
const (
	LengthFixed   LengthKind = "fixed"   // always Min
	LengthUniform LengthKind = "uniform" // uniform over Min..Max, both included
	LengthChat    LengthKind = "chat"    // a chat dataset's histogram (chatPromptBins or chatReplyBins)
)

// Lengths is a distribution of token counts.
type Lengths struct {
	Kind     LengthKind `json:"kind"`
	Min      int        `json:"min"`
	Max      int        `json:"max"`
	Spec     string     `json:"spec"` // as given on the command line
	forReply bool       // chat: the reply histogram rather than the prompt one
}

// bin is a histogram bin: lengths lo..hi-1, drawn uniformly, with a
// weight.
type bin struct {
	lo, hi int
	weight float64
}

// chatPromptBins and chatReplyBins imitate the shape of the length
// histograms of a public multi-turn chat dataset of user prompts and
// assistant replies (ShareGPT, as vllm's benchmark samples it): prompts
// peak between 64 and 512 tokens with a long tail to several thousand;
// replies peak between 128 and 512 tokens. The numbers are approximate,
// on log2 bins, written here from published summaries of that dataset's
// lengths, not measured by kvxfer; they give the benchmark a realistic
// spread, not the dataset itself.
var (
	chatPromptBins = []bin{
		{4, 16, 0.06}, {16, 32, 0.09}, {32, 64, 0.13}, {64, 128, 0.16}, {128, 256, 0.19},
		{256, 512, 0.17}, {512, 1024, 0.12}, {1024, 2048, 0.06}, {2048, 4096, 0.02},
	}
	chatReplyBins = []bin{
		{1, 16, 0.05}, {16, 64, 0.12}, {64, 128, 0.15}, {128, 256, 0.25}, {256, 512, 0.28},
		{512, 1024, 0.13}, {1024, 2048, 0.02},
	}
)

// ParseLengths parses a distribution: "N" or "fixed:N", "uniform:A-B"
// (A..B, both included) or "chat" (the chat histogram, of prompts or,
// with reply, of replies). Lengths are at least 1.
func ParseLengths(spec string, reply bool) (Lengths, error) {
	s := strings.TrimSpace(spec)
	kind, arg, hasArg := strings.Cut(s, ":")
	if !hasArg {
		if s == string(LengthChat) {
			l := Lengths{Kind: LengthChat, Spec: s, forReply: reply}
			bins := l.bins()
			l.Min, l.Max = bins[0].lo, bins[len(bins)-1].hi-1
			return l, nil
		}
		kind, arg = string(LengthFixed), s
	}
	switch LengthKind(kind) {
	case LengthFixed:
		n, err := strconv.Atoi(arg)
		if err != nil || n < 1 {
			return Lengths{}, fmt.Errorf("%w: %q: want a length of at least 1 (N, fixed:N, uniform:A-B or chat)", ErrBadLengths, spec)
		}
		return Lengths{Kind: LengthFixed, Min: n, Max: n, Spec: s}, nil
	case LengthUniform:
		a, b, ok := strings.Cut(arg, "-")
		lo, err1 := strconv.Atoi(a)
		hi, err2 := strconv.Atoi(b)
		if !ok || err1 != nil || err2 != nil || lo < 1 || hi < lo {
			return Lengths{}, fmt.Errorf("%w: %q: want uniform:A-B with 1 <= A <= B", ErrBadLengths, spec)
		}
		return Lengths{Kind: LengthUniform, Min: lo, Max: hi, Spec: s}, nil
	}
	return Lengths{}, fmt.Errorf("%w: %q: unknown kind %q (want N, fixed:N, uniform:A-B or chat)", ErrBadLengths, spec, kind)
}

func (l Lengths) bins() []bin {
	if l.forReply {
		return chatReplyBins
	}
	return chatPromptBins
}

// draw returns one length drawn from l with r.
func (l Lengths) draw(r *rand.Rand) int {
	switch l.Kind {
	case LengthUniform:
		return l.Min + r.IntN(l.Max-l.Min+1)
	case LengthChat:
		bins := l.bins()
		total := 0.0
		for _, b := range bins {
			total += b.weight
		}
		u := r.Float64() * total
		for _, b := range bins {
			if u < b.weight {
				return b.lo + r.IntN(b.hi-b.lo)
			}
			u -= b.weight
		}
		last := bins[len(bins)-1]
		return last.lo + r.IntN(last.hi-last.lo)
	}
	return l.Min
}
