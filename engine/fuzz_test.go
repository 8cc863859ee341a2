package engine

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzTextStream: whatever the bytes and stop strings, the streamed pieces
// add up to the final text, which contains no stop string, ends where the
// first stop string ended, and no piece but the last ends inside a UTF-8
// sequence that the next bytes complete.
func FuzzTextStream(f *testing.F) {
	f.Add([]byte("hello world"), "wor", "")
	f.Add([]byte("é世\xe4\xb8"), "世", "x")
	f.Add([]byte("aaaa"), "aa", "aaa")
	f.Fuzz(func(t *testing.T, in []byte, s1, s2 string) {
		ts := newTextStream([]string{s1, s2})
		var pieces []string
		stopped := false
		n := 0
		for _, c := range in {
			p, hit := ts.push(int32(c))
			pieces = append(pieces, p)
			n++
			if hit {
				stopped = true
				break
			}
		}
		pieces = append(pieces, ts.flush())
		text := strings.Join(pieces, "")
		if text != ts.text() {
			t.Fatalf("pieces %q add up to %q, text %q", pieces, text, ts.text())
		}
		consumed := string(in[:n])
		longest := -1
		for _, s := range []string{s1, s2} {
			if s == "" {
				continue
			}
			if strings.Contains(text, s) {
				t.Fatalf("text %q contains stop %q", text, s)
			}
			if strings.HasSuffix(consumed, s) {
				longest = max(longest, len(s))
			}
		}
		switch {
		case stopped && (longest < 0 || text != consumed[:n-longest]):
			t.Fatalf("stopped: text %q, input %q, stops %q %q", text, consumed, s1, s2)
		case !stopped && text != consumed:
			t.Fatalf("no stop: text %q, input %q", text, consumed)
		}
		for i, p := range pieces[:len(pieces)-1] {
			if p != "" && utf8.Valid([]byte(consumed)) && !utf8.ValidString(p) {
				t.Fatalf("piece %d %q splits a UTF-8 sequence of valid input", i, p)
			}
		}
	})
}
