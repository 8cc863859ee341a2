package serving

import (
	"reflect"
	"slices"
	"strconv"
	"testing"
)

func mustLengths(t *testing.T, spec string, reply bool) Lengths {
	t.Helper()
	l, err := ParseLengths(spec, reply)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestParseLengths(t *testing.T) {
	for _, tc := range []struct {
		spec     string
		kind     LengthKind
		min, max int
		bad      bool
	}{
		{"128", LengthFixed, 128, 128, false},
		{"fixed:7", LengthFixed, 7, 7, false},
		{"uniform:64-512", LengthUniform, 64, 512, false},
		{"uniform:5-5", LengthUniform, 5, 5, false},
		{"chat", LengthChat, 4, 4095, false},
		{"0", "", 0, 0, true},
		{"-3", "", 0, 0, true},
		{"uniform:9-3", "", 0, 0, true},
		{"uniform:0-3", "", 0, 0, true},
		{"uniform:3", "", 0, 0, true},
		{"zipf:3", "", 0, 0, true},
		{"", "", 0, 0, true},
	} {
		l, err := ParseLengths(tc.spec, false)
		if (err != nil) != tc.bad || l.Kind != tc.kind || l.Min != tc.min || l.Max != tc.max {
			t.Errorf("ParseLengths(%q) = %+v, %v; want %s %d..%d, error %v", tc.spec, l, err, tc.kind, tc.min, tc.max, tc.bad)
		}
	}
}

func testWorkload(t *testing.T, seed uint64) Workload {
	return Workload{Seed: seed, NumPrompts: 50, Turns: 3, SystemPromptLen: 20,
		Input: mustLengths(t, "uniform:10-40", false), Output: mustLengths(t, "chat", true)}
}

// TestWorkloadDeterminism: the same seed gives the same conversations and
// system prompt; another seed other ones.
func TestWorkloadDeterminism(t *testing.T) {
	a, b, c := testWorkload(t, 1), testWorkload(t, 1), testWorkload(t, 2)
	if !reflect.DeepEqual(a.Conversations(), b.Conversations()) || !slices.Equal(a.SystemPrompt(), b.SystemPrompt()) {
		t.Fatal("the same seed gave different workloads")
	}
	if reflect.DeepEqual(a.Conversations(), c.Conversations()) {
		t.Fatal("seeds 1 and 2 gave the same workload")
	}
}

// TestWorkloadShape: NumPrompts turns in all, Turns per conversation (the
// last shorter), lengths within the distributions, byte tokens only.
func TestWorkloadShape(t *testing.T) {
	w := testWorkload(t, 9)
	convs := w.Conversations()
	if len(convs) != 17 {
		t.Fatalf("%d conversations, want 17 (50 turns, 3 a conversation)", len(convs))
	}
	total := 0
	for i, c := range convs {
		want := 3
		if i == len(convs)-1 {
			want = 2
		}
		if len(c.Turns) != want {
			t.Errorf("conversation %d has %d turns, want %d", i, len(c.Turns), want)
		}
		for _, turn := range c.Turns {
			total++
			if n := len(turn.User); n < 10 || n > 40 {
				t.Errorf("user text of %d tokens, want 10..40", n)
			}
			if turn.MaxTokens < 1 || turn.MaxTokens > 2047 {
				t.Errorf("max_tokens %d outside the reply histogram", turn.MaxTokens)
			}
			for _, id := range turn.User {
				if id < 0 || id > 255 {
					t.Fatalf("token %d is not a byte", id)
				}
			}
		}
	}
	if total != 50 {
		t.Errorf("%d turns, want 50", total)
	}
	if sp := w.SystemPrompt(); len(sp) != 20 {
		t.Errorf("system prompt of %d tokens, want 20", len(sp))
	}
}

// TestPromptLength: without a system prompt, a single-turn prompt is
// exactly input_len tokens, BOS first.
func TestPromptLength(t *testing.T) {
	for _, n := range []int{1, 2, 128, 2048} {
		w := Workload{Seed: 1, NumPrompts: 3, Turns: 1, Input: mustLengths(t, "fixed:"+strconv.Itoa(n), false), Output: mustLengths(t, "4", true)}
		for _, c := range w.Conversations() {
			p := Prompt(w.SystemPrompt(), c, 0, nil)
			if len(p) != n || p[0] != BOS {
				t.Fatalf("input_len %d: prompt of %d tokens starting %d", n, len(p), p[0])
			}
		}
	}
}

// TestPromptHistory: turn n's prompt is BOS, the system prompt, every
// earlier user text and answer in order, then its own user text.
func TestPromptHistory(t *testing.T) {
	sys := []int32{'s', 'y'}
	c := Conversation{Turns: []Turn{{User: []int32{'a'}}, {User: []int32{'b', 'b'}}, {User: []int32{'c'}}}}
	answers := [][]int32{{'1', '1'}, {'2'}}
	want := []int32{BOS, 's', 'y', 'a', '1', '1', 'b', 'b', '2', 'c'}
	if got := Prompt(sys, c, 2, answers); !slices.Equal(got, want) {
		t.Errorf("turn 2: %v, want %v", got, want)
	}
	if got := Prompt(sys, c, 0, nil); !slices.Equal(got, []int32{BOS, 's', 'y', 'a'}) {
		t.Errorf("turn 0: %v", got)
	}
}

// TestChatLengths: the chat histograms' draws follow their weights: the
// share of draws in each bin is its weight, within 1.5 points.
func TestChatLengths(t *testing.T) {
	for _, reply := range []bool{false, true} {
		l := mustLengths(t, "chat", reply)
		w := Workload{Seed: 4, NumPrompts: 20000, Turns: 1, Input: l, Output: l}
		bins := l.bins()
		counts := make([]int, len(bins))
		for _, c := range w.Conversations() {
			n := c.Turns[0].MaxTokens
			i := slices.IndexFunc(bins, func(b bin) bool { return n >= b.lo && n < b.hi })
			if i < 0 {
				t.Fatalf("length %d in no bin", n)
			}
			counts[i]++
		}
		total := 0.0
		for _, b := range bins {
			total += b.weight
		}
		for i, b := range bins {
			share := float64(counts[i]) / 20000
			if d := share - b.weight/total; d > 0.015 || d < -0.015 {
				t.Errorf("reply %v: bin %d..%d has %.3f of draws, want %.3f", reply, b.lo, b.hi, share, b.weight/total)
			}
		}
	}
}

func FuzzParseLengths(f *testing.F) {
	for _, s := range []string{"128", "fixed:1", "uniform:1-9", "chat", "uniform:-", "fixed:", ":"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		l, err := ParseLengths(s, false)
		if err != nil {
			return
		}
		if l.Min < 1 || l.Max < l.Min {
			t.Fatalf("%q parsed to %+v", s, l)
		}
	})
}

func FuzzParseSLO(f *testing.F) {
	for _, s := range []string{"ttft:200 tpot:20", "e2el:1", "ttft:", "x:1", "ttft:1e400"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		slo, err := ParseSLO([]string{s})
		if err != nil {
			return
		}
		if slo.TTFTMs < 0 || slo.TPOTMs < 0 || slo.E2ELMs < 0 {
			t.Fatalf("%q parsed to %+v", s, slo)
		}
	})
}
