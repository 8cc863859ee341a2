package engine

import (
	"strings"
	"testing"
)

func TestTokenizerRoundTrip(t *testing.T) {
	for _, s := range []string{"", "hello", "héllo, 世界 🙂", "\x00\xff binary"} {
		ids := Tokenizer{}.Encode(s)
		if len(ids) != len(s)+1 || ids[0] != BOS {
			t.Errorf("Encode(%q) = %v: want BOS and one token per byte", s, ids)
		}
		if got := (Tokenizer{}).Decode(ids); got != s {
			t.Errorf("Decode(Encode(%q)) = %q", s, got)
		}
		withEOS := append(append([]int32{}, ids...), EOS, BOS)
		if got := (Tokenizer{}).Decode(withEOS); got != s {
			t.Errorf("Decode with specials = %q, want %q", got, s)
		}
	}
}

// TestTextStream: streamed pieces never split a UTF-8 sequence or show
// part of a stop string, and add up to the final text.
func TestTextStream(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		stops  []string
		pieces []string // text returned by each push, then by flush
		stop   bool
	}{
		{"ascii", "abc", nil, []string{"a", "b", "c", ""}, false},
		{"multi-byte held until complete", "é世", nil, []string{"", "é", "", "", "世", ""}, false},
		{"cut inside a multi-byte sequence", "a\xe4\xb8", nil, []string{"a", "", "", "\xe4\xb8"}, false},
		{"stop string", "abXYc", []string{"XY"}, []string{"", "a", "b", "", ""}, true},
		{"stop prefix that does not match", "aXbY", []string{"XY"}, []string{"", "a", "X", "b", "Y"}, false},
		{"longest stop holds back", "abcdef", []string{"zzz", "q"}, []string{"", "", "a", "b", "c", "d", "ef"}, false},
		{"stop at the start", "XYab", []string{"XY"}, []string{"", "", ""}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ts := newTextStream(tc.stops)
			var got []string
			stopped := false
			for i := 0; i < len(tc.in) && !stopped; i++ {
				p, hit := ts.push(int32(tc.in[i]))
				got = append(got, p)
				stopped = hit
			}
			got = append(got, ts.flush())
			if strings.Join(got, "|") != strings.Join(tc.pieces, "|") || stopped != tc.stop {
				t.Errorf("pieces %q stop %v, want %q stop %v", got, stopped, tc.pieces, tc.stop)
			}
			if strings.Join(got, "") != ts.text() {
				t.Errorf("pieces add up to %q, text is %q", strings.Join(got, ""), ts.text())
			}
		})
	}
	if p, hit := newTextStream(nil).push(EOS); p != "" || hit {
		t.Errorf("EOS produced %q", p)
	}
}
