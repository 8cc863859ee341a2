package serving

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

// fakeClock returns the times of a script, one per call.
func fakeClock(start time.Time, offsetsMs ...float64) func() time.Time {
	i := 0
	return func() time.Time {
		t := start.Add(msd(offsetsMs[i]))
		i++
		return t
	}
}

// TestReadStreamTiming: TTFT at the first chunk with token ids (not at a
// role-only or empty chunk), an ITL per later chunk with ids, E2EL at
// [DONE], usage and kvxfer_timing read.
func TestReadStreamTiming(t *testing.T) {
	body := `data: {"choices":[{"text":"","token_ids":[]}]}

data: {"choices":[{"text":"a","token_ids":[97]}]}

: a comment line

data: {"choices":[{"text":"bc","token_ids":[98,99]}]}

data: {"choices":[{"text":"","token_ids":[]}]}

data: {"choices":[{"text":"d","token_ids":[100],"finish_reason":"length"}]}

data: {"choices":[],"usage":{"completion_tokens":4,"kvxfer_timing":{"kv_transfer_ms":1.5,"kv_transfer_bytes":4096}}}

data: [DONE]

`
	start := time.Unix(1000, 0)
	a, err := readStream(strings.NewReader(body), start, fakeClock(start, 5, 40, 55, 60, 80, 81, 82))
	if err != nil {
		t.Fatal(err)
	}
	if ms(a.ttft) != 40 || ms(a.e2el) != 82 || !slices.Equal(a.itl, []time.Duration{msd(15), msd(25)}) {
		t.Errorf("ttft %v e2el %v itl %v; want 40ms, 82ms, [15ms 25ms]", a.ttft, a.e2el, a.itl)
	}
	if !slices.Equal(a.ids, []int32{97, 98, 99, 100}) || a.usage != 4 || a.timing == nil || a.timing.KVTransferBytes != 4096 {
		t.Errorf("ids %v usage %d timing %+v", a.ids, a.usage, a.timing)
	}
}

// TestReadStreamErrors: each way a stream fails has its kind.
func TestReadStreamErrors(t *testing.T) {
	for _, tc := range []struct {
		name, body, kind string
	}{
		{"error event", "data: {\"choices\":[{\"token_ids\":[1]}]}\n\ndata: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n", ErrorEvent},
		{"no [DONE]", "data: {\"choices\":[{\"token_ids\":[1]}]}\n\n", ErrorIncomplete},
		{"empty", "", ErrorIncomplete},
		{"bad json", "data: {\"choices\":\n\n", ErrorBadEvent},
		{"no tokens", "data: {\"choices\":[{\"text\":\"\"}]}\n\ndata: [DONE]\n\n", ErrorNoTokens},
		{"event over the limit", "data: " + strings.Repeat("x", MaxEvent+1) + "\n\n", ErrorIncomplete},
	} {
		_, err := readStream(strings.NewReader(tc.body), time.Now(), time.Now)
		var re *RequestError
		if !errors.As(err, &re) || re.Kind != tc.kind {
			t.Errorf("%s: %v, want kind %s", tc.name, err, tc.kind)
		}
	}
}

// FuzzReadStream: any body ends in an answer or a RequestError with a
// known kind, and the answer's counts agree with each other.
func FuzzReadStream(f *testing.F) {
	f.Add("data: {\"choices\":[{\"token_ids\":[1,2]}]}\n\ndata: [DONE]\n\n")
	f.Add("data: {\"choices\":[],\"usage\":{\"completion_tokens\":3,\"kvxfer_timing\":{}}}\n\ndata: [DONE]\n")
	f.Add("data: {\"choices\":[{\"token_ids\":[1]}],\"usage\":{\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":64},\"kvxfer_timing\":{\"kv_transfer_blocks\":2,\"kv_block_bytes\":9}}}\n\ndata: [DONE]\n")
	f.Add("data: {\"choices\":[{\"token_ids\":[1]}],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":-3}}}\n\ndata: [DONE]\n")
	f.Add("data: {\"error\":{\"message\":\"x\"}}\n")
	f.Add("data: [DONE]")
	kinds := []string{ErrorEvent, ErrorIncomplete, ErrorBadEvent, ErrorNoTokens}
	f.Fuzz(func(t *testing.T, body string) {
		a, err := readStream(strings.NewReader(body), time.Now(), time.Now)
		if err != nil {
			var re *RequestError
			if !errors.As(err, &re) || !slices.Contains(kinds, re.Kind) {
				t.Fatalf("error %v of no known kind", err)
			}
			return
		}
		chunks := 0
		if len(a.ids) > 0 {
			chunks = 1 + len(a.itl)
		}
		if chunks > len(a.ids) || a.e2el < a.ttft {
			t.Fatalf("%d chunks for %d ids; ttft %v e2el %v", chunks, len(a.ids), a.ttft, a.e2el)
		}
		if a.cached < -1 || (a.cached >= 0 && a.usage < 0) {
			t.Fatalf("cached_tokens %d without a usage chunk (usage %d)", a.cached, a.usage)
		}
	})
}
