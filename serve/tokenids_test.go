package serve

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/engine"
)

// TestReturnTokenIDs: with return_token_ids a worker's answer carries the
// generated ids (as many as usage counts, decoding to the answer's text)
// and the prompt's ids; a stream's chunks carry the same ids in order, and
// without the flag no chunk or choice carries any.
func TestReturnTokenIDs(t *testing.T) {
	agg := newTestWorker(t, RoleBoth, "tiny-gqa", 1, 1)
	for _, temp := range []float64{0, 0.9} {
		body := map[string]any{"prompt": "The quick brown fox", "max_tokens": 24, "temperature": temp, "seed": 7,
			"ignore_eos": true, "return_token_ids": true}
		code, got, raw := postJSON(t, agg.srv.URL+"/v1/completions", body)
		if code != 200 || len(got.Choices) != 1 {
			t.Fatalf("temp %v: %d %s", temp, code, raw)
		}
		ids := got.Choices[0].TokenIDs
		if len(ids) != 24 || got.Usage.CompletionTokens != 24 {
			t.Fatalf("temp %v: %d token ids, usage %d, want 24 (ignore_eos): %s", temp, len(ids), got.Usage.CompletionTokens, raw)
		}
		// As JSON carries it: invalid UTF-8 bytes become U+FFFD.
		b, _ := json.Marshal((engine.Tokenizer{}).Decode(ids))
		var text string
		json.Unmarshal(b, &text)
		if text != got.Choices[0].Text {
			t.Errorf("temp %v: ids decode to %q, text is %q", temp, text, got.Choices[0].Text)
		}
		if want := (engine.Tokenizer{}).Encode("The quick brown fox"); !slices.Equal(got.PromptTokenIDs, want) {
			t.Errorf("temp %v: prompt_token_ids %v, want %v", temp, got.PromptTokenIDs, want)
		}
		body["stream"] = true
		body["stream_options"] = map[string]any{"include_usage": true}
		sr, err := StreamCompletion(context.Background(), http.DefaultClient, agg.srv.URL, body)
		if err != nil {
			t.Fatal(err)
		}
		if sr.CompletionTokens != 24 {
			t.Errorf("temp %v: streamed usage.completion_tokens %d, want 24", temp, sr.CompletionTokens)
		}
		delete(body, "stream_options")
		if !slices.Equal(sr.TokenIDs, ids) || sr.Text != got.Choices[0].Text || sr.FinishReason != "length" {
			t.Errorf("temp %v: streamed ids %v text %q finish %q, want %v %q length", temp, sr.TokenIDs, sr.Text, sr.FinishReason, ids, got.Choices[0].Text)
		}
		delete(body, "return_token_ids")
		sr, err = StreamCompletion(context.Background(), http.DefaultClient, agg.srv.URL, body)
		if err != nil || sr.TokenIDs != nil || sr.Text != got.Choices[0].Text {
			t.Errorf("temp %v, no return_token_ids: ids %v text %q err %v", temp, sr.TokenIDs, sr.Text, err)
		}
		delete(body, "stream")
		if _, plain, raw := postJSON(t, agg.srv.URL+"/v1/completions", body); plain.Choices[0].TokenIDs != nil || plain.PromptTokenIDs != nil {
			t.Errorf("temp %v: ids without return_token_ids: %s", temp, raw)
		}
	}
}
