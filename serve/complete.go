package serve

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	"github.com/kvxfer/kvxfer/transceiver"
)

// timingJSON is kvxfer's time split of a request, in usage.kvxfer_timing.
type timingJSON struct {
	QueueMs         float64 `json:"queue_ms"`
	PrefillMs       float64 `json:"prefill_ms"`
	KVTransferMs    float64 `json:"kv_transfer_ms"`
	KVTransferBytes int64   `json:"kv_transfer_bytes"`
	// KVTransferBlocks and KVBlockBytes (generation_only) are the blocks
	// the worker asked the context worker for (those it lacked) and the
	// size of one, summed over its ranks.
	KVTransferBlocks int     `json:"kv_transfer_blocks"`
	KVBlockBytes     int64   `json:"kv_block_bytes"`
	FirstDecodeMs    float64 `json:"first_decode_ms"`
	TotalMs          float64 `json:"total_ms"`
}

type usageJSON struct {
	PromptTokens     int                 `json:"prompt_tokens"`
	CompletionTokens int                 `json:"completion_tokens"`
	TotalTokens      int                 `json:"total_tokens"`
	Details          promptTokensDetails `json:"prompt_tokens_details"`
	Timing           *timingJSON         `json:"kvxfer_timing,omitempty"`
}

// promptTokensDetails is OpenAI's usage.prompt_tokens_details: the prompt
// tokens found in the worker's reusable cache.
type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// usageOf is a finished request's usage, its cached tokens in whole blocks
// (Worker.shown).
func (w *Worker) usageOf(f *engine.Final) *usageJSON {
	t := f.Timing
	return &usageJSON{PromptTokens: f.Usage.PromptTokens, CompletionTokens: f.Usage.CompletionTokens,
		TotalTokens: f.Usage.PromptTokens + f.Usage.CompletionTokens, Details: promptTokensDetails{CachedTokens: w.shown(f.Usage.CachedTokens)},
		Timing: &timingJSON{QueueMs: msOf(t.Queue), PrefillMs: msOf(t.Prefill), KVTransferMs: msOf(t.KVTransfer),
			KVTransferBytes: t.TransferBytes, KVTransferBlocks: t.TransferBlocks, KVBlockBytes: t.BlockBytes,
			FirstDecodeMs: msOf(t.FirstDecode), TotalMs: msOf(t.Total)}}
}

// disaggOf is the disaggregated_params of a context_only answer.
func disaggOf(f *engine.Final) *DisaggregatedParams {
	cp := f.ContextPhase
	if cp == nil {
		return nil
	}
	id := cp.CtxRequestID
	return &DisaggregatedParams{RequestType: TypeContextOnly, FirstGenTokens: cp.FirstGenTokens, CtxRequestID: &id,
		EncodedOpaqueState: base64.StdEncoding.EncodeToString(cp.OpaqueState), DraftTokens: cp.DraftTokens}
}

// complete serves /v1/completions and /v1/chat/completions.
func (w *Worker) complete(rw http.ResponseWriter, r *http.Request, chat bool) {
	arrived := time.Now()
	body, herr := readBody(r)
	if herr != nil {
		writeError(rw, herr.code, herr.typ, herr.msg)
		return
	}
	cr, er, herr := w.parse(body, chat)
	if herr != nil {
		writeError(rw, herr.code, herr.typ, herr.msg)
		return
	}
	stream, err := w.eng.Submit(r.Context(), er)
	if err != nil {
		code, typ := statusOf(err)
		writeError(rw, code, typ, err.Error())
		return
	}
	id := fmt.Sprintf("cmpl-%d", w.seq.Add(1))
	object := "text_completion"
	if chat {
		id, object = "chat"+id[4:], "chat.completion"
	}
	if cr.Stream {
		w.streamEvents(rw, stream, id, object, chat, streamFlags{usage: cr.StreamOptions != nil && cr.StreamOptions.IncludeUsage, ids: cr.ReturnTokenIDs}, arrived)
		return
	}
	var text []byte
	ids := []int32{}
	var final *engine.Final
	first := true
	for ev := range stream.Events() {
		if ev.Final != nil {
			final = ev.Final
		} else {
			ids = append(ids, ev.Token)
			if first {
				first = false
				w.m.TTFT.Observe(time.Since(arrived).Seconds())
			}
		}
		text = append(text, ev.Text...)
	}
	if final == nil || final.FinishReason == engine.FinishError {
		var ferr error = fmt.Errorf("request ended without a result")
		if final != nil && final.Err != nil {
			ferr = final.Err
		}
		code, typ := statusOf(ferr)
		writeError(rw, code, typ, ferr.Error())
		return
	}
	w.observeFinal(final)
	choice := map[string]any{"index": 0, "finish_reason": final.FinishReason, "logprobs": nil}
	if chat {
		choice["message"] = map[string]any{"role": "assistant", "content": string(text)}
	} else {
		choice["text"] = string(text)
	}
	if dp := disaggOf(final); dp != nil {
		choice["disaggregated_params"] = dp
	}
	if cr.ReturnTokenIDs {
		choice["token_ids"] = ids
	}
	resp := map[string]any{"id": id, "object": object, "created": time.Now().Unix(), "model": w.model,
		"choices": []any{choice}, "usage": w.usageOf(final)}
	if er.Type == transceiver.ContextOnly || cr.ReturnTokenIDs {
		resp["prompt_token_ids"] = final.PromptTokenIDs
	}
	rw.Header().Set("Content-Type", "application/json")
	json.NewEncoder(rw).Encode(resp)
}

// observeFinal counts a finished request: its prompt and cached tokens, and
// its time per output token.
func (w *Worker) observeFinal(f *engine.Final) {
	w.promptTokens.Add(float64(f.Usage.PromptTokens))
	w.cachedTokens.Add(float64(w.shown(f.Usage.CachedTokens)))
	if n := f.Usage.CompletionTokens - 1; n > 0 && f.Timing.Decode > 0 {
		w.m.TPOT.Observe(f.Timing.Decode.Seconds() / float64(n))
	}
}

// streamFlags are a stream's options: the usage chunk (stream_options.
// include_usage) and token ids in the chunks (return_token_ids).
type streamFlags struct{ usage, ids bool }

// streamEvents writes the stream as server-sent events: one chunk per
// piece of text, a last chunk with the finish reason, the usage chunk when
// asked, and [DONE]. With return_token_ids a chunk carries the ids of the
// tokens whose text it completes (a token whose text is held back rides
// with the next chunk), so the ids a client has seen always match the text
// it has seen. An error after the stream started is sent as an error event,
// then the stream ends.
func (w *Worker) streamEvents(rw http.ResponseWriter, s *engine.Stream, id, object string, chat bool, fl streamFlags, arrived time.Time) {
	rw.Header().Set("Content-Type", "text/event-stream")
	rw.Header().Set("Cache-Control", "no-cache")
	flusher, _ := rw.(http.Flusher)
	created := time.Now().Unix()
	object += ".chunk"
	if !chat {
		object = "text_completion"
	}
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(rw, "data: %s\n\n", b); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	var pending []int32 // generated ids not yet sent (return_token_ids)
	chunk := func(text string, finish any) map[string]any {
		c := map[string]any{"index": 0, "finish_reason": finish, "logprobs": nil}
		if fl.ids {
			c["token_ids"] = append([]int32{}, pending...)
			pending = pending[:0]
		}
		if chat {
			c["delta"] = map[string]any{"content": text}
		} else {
			c["text"] = text
		}
		return map[string]any{"id": id, "object": object, "created": created, "model": w.model, "choices": []any{c}}
	}
	if chat {
		first := chunk("", nil)
		first["choices"].([]any)[0].(map[string]any)["delta"] = map[string]any{"role": "assistant", "content": ""}
		if !send(first) {
			return
		}
	}
	firstToken := true
	for ev := range s.Events() {
		if ev.Final == nil {
			if firstToken {
				firstToken = false
				w.m.TTFT.Observe(time.Since(arrived).Seconds())
			}
			if fl.ids {
				pending = append(pending, ev.Token)
			}
			if ev.Text != "" && !send(chunk(ev.Text, nil)) {
				return // the client left; its context cancels the request
			}
			continue
		}
		f := ev.Final
		if f.FinishReason == engine.FinishError {
			code, typ := statusOf(f.Err)
			var e APIError
			e.Error.Message, e.Error.Type, e.Error.Code = f.Err.Error(), typ, code
			send(e)
			return
		}
		w.observeFinal(f)
		last := chunk(ev.Text, f.FinishReason)
		if dp := disaggOf(f); dp != nil {
			last["choices"].([]any)[0].(map[string]any)["disaggregated_params"] = dp
		}
		if !send(last) {
			return
		}
		if fl.usage {
			send(map[string]any{"id": id, "object": object, "created": created, "model": w.model, "choices": []any{}, "usage": w.usageOf(f)})
		}
	}
	fmt.Fprint(rw, "data: [DONE]\n\n")
	if flusher != nil {
		flusher.Flush()
	}
}
