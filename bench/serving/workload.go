package serving

import (
	"errors"
	"fmt"
	"math/rand/v2"
)

// BOS is the engine's beginning-of-sequence token id, the first of every
// prompt; ids 0..255 are bytes (package engine's tokenizer).
const BOS = 256

// ErrBadWorkload: a workload that cannot be generated.
var ErrBadWorkload = errors.New("serving: bad workload")

// Workload is what is sent, as a pure function of Seed.
type Workload struct {
	Seed uint64 `json:"seed"`
	// NumPrompts is the number of requests (turns, over every
	// conversation).
	NumPrompts int `json:"num_prompts"`
	// Input is the length of each turn's new user text (the whole prompt
	// of a single-turn request, BOS included, when SystemPromptLen is 0);
	// Output is each answer's max_tokens.
	Input  Lengths `json:"input_len"`
	Output Lengths `json:"output_len"`
	// Turns per conversation (1: independent requests). Turn n's prompt is
	// BOS, the system prompt, then every earlier turn's user text and
	// answer, then its own user text.
	Turns int `json:"turns"`
	// SystemPromptLen is the length of the system prompt every
	// conversation starts with (the same tokens for all).
	SystemPromptLen int `json:"system_prompt_len"`
}

// Conversation is the user side of one conversation: its turns' texts
// and requested output lengths. The answers come from the server.
type Conversation struct {
	Turns []Turn
}

// Turn is one request of a conversation.
type Turn struct {
	User      []int32 // the turn's new user tokens
	MaxTokens int     // the answer's requested length
}

// Validate reports what is wrong with w, naming the field.
func (w Workload) Validate() error {
	var errs []error
	if w.NumPrompts < 1 {
		errs = append(errs, fmt.Errorf("%w: num_prompts = %d, want at least 1", ErrBadWorkload, w.NumPrompts))
	}
	if w.Turns < 1 {
		errs = append(errs, fmt.Errorf("%w: turns = %d, want at least 1", ErrBadWorkload, w.Turns))
	}
	if w.SystemPromptLen < 0 {
		errs = append(errs, fmt.Errorf("%w: system_prompt_len = %d, want 0 or more", ErrBadWorkload, w.SystemPromptLen))
	}
	for _, l := range []struct {
		name string
		l    Lengths
	}{{"input_len", w.Input}, {"output_len", w.Output}} {
		if l.l.Kind == "" || l.l.Min < 1 || l.l.Max < l.l.Min {
			errs = append(errs, fmt.Errorf("%w: %s %q is not a parsed distribution of lengths >= 1", ErrBadWorkload, l.name, l.l.Spec))
		}
	}
	return errors.Join(errs...)
}

// SystemPrompt returns the system prompt of w (BOS not included).
func (w Workload) SystemPrompt() []int32 {
	r := rand.New(rand.NewPCG(w.Seed, 0x5e5))
	return text(r, w.SystemPromptLen)
}

// Conversations returns the conversations of w: NumPrompts turns in all,
// Turns per conversation (the last one shorter when they do not divide).
// The same Workload gives the same conversations.
func (w Workload) Conversations() []Conversation {
	r := rand.New(rand.NewPCG(w.Seed, 0xc0))
	n := (w.NumPrompts + w.Turns - 1) / w.Turns
	convs := make([]Conversation, n)
	left := w.NumPrompts
	for i := range convs {
		turns := min(w.Turns, left)
		left -= turns
		convs[i].Turns = make([]Turn, turns)
		for t := range convs[i].Turns {
			in := w.Input.draw(r)
			if t == 0 && w.SystemPromptLen == 0 {
				in-- // BOS is the first token of the prompt
			}
			convs[i].Turns[t] = Turn{User: text(r, in), MaxTokens: w.Output.draw(r)}
		}
	}
	return convs
}

// Prompt returns the prompt of turn t given the answers of the earlier
// turns: BOS, system, then user and answer of each earlier turn, then
// the turn's user tokens.
func Prompt(system []int32, c Conversation, t int, answers [][]int32) []int32 {
	n := 1 + len(system)
	for i := 0; i <= t; i++ {
		n += len(c.Turns[i].User)
		if i < t {
			n += len(answers[i])
		}
	}
	p := make([]int32, 0, n)
	p = append(p, BOS)
	p = append(p, system...)
	for i := range t {
		p = append(p, c.Turns[i].User...)
		p = append(p, answers[i]...)
	}
	return append(p, c.Turns[t].User...)
}

// words are what synthetic text is made of: lower-case ASCII words and
// spaces, so a prompt is readable bytes (a token each).
var words = []string{"the", "cache", "of", "keys", "and", "values", "moves", "from", "prefill", "to", "decode",
	"over", "a", "fast", "link", "while", "tokens", "stream", "back", "model", "layer", "block", "rank", "request"}

// text returns n tokens of words separated by spaces.
func text(r *rand.Rand, n int) []int32 {
	out := make([]int32, 0, max(n, 0))
	for len(out) < n {
		if len(out) > 0 {
			out = append(out, ' ')
		}
		for _, c := range []byte(words[r.IntN(len(words))]) {
			if len(out) == n {
				break
			}
			out = append(out, int32(c))
		}
	}
	return out[:max(n, 0)]
}
