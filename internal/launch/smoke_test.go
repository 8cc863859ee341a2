package launch

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// fake is what a fake worker answers: text in pieces, the finish reason,
// usage counting tokens, and token ids (plainIDs, when set, in the answers
// that do not stream).
type fake struct {
	text     string
	finish   string
	tokens   int
	ids      []int32
	plainIDs []int32
}

// idsOf is n token ids, from seed.
func idsOf(n int, seed int32) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = (seed + int32(i)*7) % 256
	}
	return ids
}

// fakeWorker answers every completion with f: streamed, text in pieces
// with their token ids, then finish, the usage chunk and [DONE]; or not
// streamed, in one answer. It checks that the request asks for ignore_eos
// and return_token_ids, and a streamed one for the usage chunk.
func fakeWorker(t *testing.T, f fake) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			IgnoreEOS      bool `json:"ignore_eos"`
			ReturnTokenIDs bool `json:"return_token_ids"`
			Stream         bool `json:"stream"`
			StreamOptions  struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || !body.IgnoreEOS || !body.ReturnTokenIDs ||
			body.Stream && !body.StreamOptions.IncludeUsage {
			http.Error(w, fmt.Sprintf("want ignore_eos, return_token_ids and include_usage when streaming: %+v %v", body, err), http.StatusBadRequest)
			return
		}
		if !body.Stream {
			ids := f.ids
			if f.plainIDs != nil {
				ids = f.plainIDs
			}
			json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"text": f.text, "finish_reason": f.finish, "token_ids": ids}},
				"usage": map[string]any{"completion_tokens": f.tokens}})
			return
		}
		ev := func(v any) {
			b, _ := json.Marshal(v)
			fmt.Fprintf(w, "data: %s\n\n", b)
		}
		pieces := strings.SplitAfter(f.text, " ")
		ids := f.ids
		for i, piece := range pieces {
			n := len(ids)
			if i < len(pieces)-1 {
				n = min(len(ids), 2)
			}
			ev(map[string]any{"choices": []any{map[string]any{"text": piece, "finish_reason": nil, "token_ids": ids[:n]}}})
			ids = ids[n:]
		}
		ev(map[string]any{"choices": []any{map[string]any{"text": "", "finish_reason": f.finish, "token_ids": ids}}})
		ev(map[string]any{"choices": []any{}, "usage": map[string]any{"completion_tokens": f.tokens}})
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestSmokeStrict: Smoke matches only answers of smokeMaxTokens token ids,
// ended by length, with the same ids and the same non-empty text on both
// sides, streamed and not; two empty answers, equal texts of other ids or
// lengths, and answers without ids do not match.
func TestSmokeStrict(t *testing.T) {
	ids := idsOf(smokeMaxTokens, 3)
	same := fake{text: "same answer", finish: "length", tokens: smokeMaxTokens, ids: ids}
	good := fakeWorker(t, same)
	with := func(mod func(*fake)) string {
		f := same
		mod(&f)
		return fakeWorker(t, f)
	}
	for _, tc := range []struct {
		name   string
		router string
		ok     bool
	}{
		{"equal", with(func(*fake) {}), true},
		{"both empty", "", false}, // both sides the empty worker below
		{"other text", with(func(f *fake) { f.text = "another answer" }), false},
		{"fewer tokens", with(func(f *fake) { f.tokens = smokeMaxTokens - 1 }), false},
		{"fewer ids", with(func(f *fake) { f.ids = ids[1:] }), false},
		{"other ids", with(func(f *fake) { f.ids = idsOf(smokeMaxTokens, 4) }), false},
		{"no ids", with(func(f *fake) { f.ids = nil }), false},
		{"other ids not streamed", with(func(f *fake) { f.plainIDs = idsOf(smokeMaxTokens, 4) }), false},
		{"stopped", with(func(f *fake) { f.finish = "stop" }), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			router, agg := tc.router, good
			if router == "" {
				empty := fakeWorker(t, fake{finish: "length", tokens: smokeMaxTokens})
				router, agg = empty, empty
			}
			res := Smoke(context.Background(), router, agg, 3, 2)
			if res.OK() != tc.ok {
				t.Fatalf("OK = %v, want %v: %d/%d matched, %v", res.OK(), tc.ok, res.Matched, res.Prompts, res.Failures)
			}
		})
	}
}
