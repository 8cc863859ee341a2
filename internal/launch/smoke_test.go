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

// fakeWorker answers every streamed completion with text in pieces, then
// finish, the usage chunk with tokens, and [DONE]. It checks that the
// request asks for ignore_eos and the usage chunk.
func fakeWorker(t *testing.T, text, finish string, tokens int) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			IgnoreEOS     bool `json:"ignore_eos"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || !body.IgnoreEOS || !body.StreamOptions.IncludeUsage {
			http.Error(w, fmt.Sprintf("want ignore_eos and include_usage: %+v %v", body, err), http.StatusBadRequest)
			return
		}
		ev := func(v any) {
			b, _ := json.Marshal(v)
			fmt.Fprintf(w, "data: %s\n\n", b)
		}
		for _, piece := range strings.SplitAfter(text, " ") {
			ev(map[string]any{"choices": []any{map[string]any{"text": piece, "finish_reason": nil}}})
		}
		ev(map[string]any{"choices": []any{map[string]any{"text": "", "finish_reason": finish}}})
		ev(map[string]any{"choices": []any{}, "usage": map[string]any{"completion_tokens": tokens}})
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestSmokeStrict: Smoke matches only answers of smokeMaxTokens tokens,
// ended by length, with the same non-empty text on both sides; two empty
// answers, or equal texts of different lengths, do not match.
func TestSmokeStrict(t *testing.T) {
	good := fakeWorker(t, "same answer", "length", smokeMaxTokens)
	for _, tc := range []struct {
		name   string
		router string
		ok     bool
	}{
		{"equal", fakeWorker(t, "same answer", "length", smokeMaxTokens), true},
		{"both empty", "", false}, // both sides the empty worker below
		{"other text", fakeWorker(t, "another answer", "length", smokeMaxTokens), false},
		{"fewer tokens", fakeWorker(t, "same answer", "length", smokeMaxTokens-1), false},
		{"stopped", fakeWorker(t, "same answer", "stop", smokeMaxTokens), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			router, agg := tc.router, good
			if router == "" {
				empty := fakeWorker(t, "", "length", smokeMaxTokens)
				router, agg = empty, empty
			}
			res := Smoke(context.Background(), router, agg, 3, 2)
			if res.OK() != tc.ok {
				t.Fatalf("OK = %v, want %v: %d/%d matched, %v", res.OK(), tc.ok, res.Matched, res.Prompts, res.Failures)
			}
		})
	}
}
