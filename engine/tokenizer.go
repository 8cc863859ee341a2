package engine

import (
	"bytes"
	"unicode/utf8"
)

// Special tokens of the byte-level vocabulary. Ids 0..255 are the bytes
// themselves.
const (
	BOS int32 = 256 // begin of sequence: Encode puts it first
	EOS int32 = 257 // end of sequence: generation stops on it unless IgnoreEOS
	// VocabSize is the number of token ids: 256 bytes and two specials.
	VocabSize = 258
)

// Tokenizer is the byte-level tokenizer of the reference models: a token per
// UTF-8 byte, plus BOS and EOS. The zero value is ready to use; it is
// stateless and safe for concurrent use.
type Tokenizer struct{}

// Encode returns BOS followed by the bytes of s.
func (Tokenizer) Encode(s string) []int32 {
	out := make([]int32, 0, len(s)+1)
	out = append(out, BOS)
	for i := 0; i < len(s); i++ {
		out = append(out, int32(s[i]))
	}
	return out
}

// Decode returns the bytes of ids as a string, dropping special tokens. The
// result is not necessarily valid UTF-8 (a generation may stop inside a
// multi-byte sequence).
func (Tokenizer) Decode(ids []int32) string {
	b := make([]byte, 0, len(ids))
	for _, id := range ids {
		if id >= 0 && id < 256 {
			b = append(b, byte(id))
		}
	}
	return string(b)
}

// textStream turns generated tokens into text pieces for streaming. It
// holds back an incomplete UTF-8 sequence at the end, and enough bytes
// that a stop string is never emitted in part: the text a client receives
// is exactly the final text, which excludes the stop string (OpenAI
// semantics).
type textStream struct {
	stops   [][]byte
	hold    int // longest stop string − 1
	buf     []byte
	emitted int
}

func newTextStream(stops []string) *textStream {
	ts := &textStream{}
	for _, s := range stops {
		if s == "" {
			continue
		}
		ts.stops = append(ts.stops, []byte(s))
		ts.hold = max(ts.hold, len(s)-1)
	}
	return ts
}

// push adds a token. It returns the text that may be sent now and whether
// the token completed a stop string (the text then ends before it; the
// caller finishes the request and flushes).
func (ts *textStream) push(tok int32) (string, bool) {
	if tok < 0 || tok >= 256 {
		return "", false
	}
	ts.buf = append(ts.buf, byte(tok))
	// Of the stop strings this byte completes, the longest starts first:
	// the text ends before it.
	cut := -1
	for _, s := range ts.stops {
		if bytes.HasSuffix(ts.buf, s) {
			cut = max(cut, len(s))
		}
	}
	if cut >= 0 {
		ts.buf = ts.buf[:len(ts.buf)-cut]
		return "", true
	}
	safe := len(ts.buf) - ts.hold
	// Hold back a trailing incomplete (but possibly valid) UTF-8 sequence.
	for i := safe - 1; i >= max(ts.emitted, safe-utf8.UTFMax+1); i-- {
		if utf8.RuneStart(ts.buf[i]) {
			if !utf8.FullRune(ts.buf[i:safe]) {
				safe = i
			}
			break
		}
	}
	if safe <= ts.emitted {
		return "", false
	}
	s := string(ts.buf[ts.emitted:safe])
	ts.emitted = safe
	return s, false
}

// flush returns the text not sent yet. The request is over.
func (ts *textStream) flush() string {
	if ts.emitted >= len(ts.buf) {
		return ""
	}
	s := string(ts.buf[ts.emitted:])
	ts.emitted = len(ts.buf)
	return s
}

// text returns the whole text so far (excluding a stop string found).
func (ts *textStream) text() string { return string(ts.buf) }
