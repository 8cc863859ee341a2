package serving

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// request is one streamed completion to send.
type request struct {
	Model     string
	Prompt    []int32
	MaxTokens int
	// ConversationID, when set, is sent in the place Field names
	// (ConversationField*).
	ConversationID, Field string
}

// answer is what a streamed completion returned, timed.
type answer struct {
	ids   []int32 // the generated ids (return_token_ids)
	ttft  time.Duration
	e2el  time.Duration
	itl   []time.Duration
	usage int // usage.completion_tokens; -1 when the stream had no usage
	// cached is usage.prompt_tokens_details.cached_tokens, -1 when the
	// usage did not carry it.
	cached int
	timing *Timing
	path   string // the PathHeader of the response ("" when absent)
}

// send posts req to base's /v1/completions as a stream (with
// return_token_ids, ignore_eos and the usage chunk) and times it: the
// first chunk carrying a token, each later one, and the [DONE] event. It
// reads the stream itself rather than through serve.StreamCompletion,
// which collects an answer but keeps no time per chunk and drops
// usage.kvxfer_timing. The error is a *RequestError naming its kind.
func send(ctx context.Context, c *http.Client, base string, req request) (answer, error) {
	a := answer{usage: -1, cached: -1}
	body := map[string]any{"prompt": req.Prompt, "max_tokens": req.MaxTokens, "ignore_eos": true, "stream": true,
		"stream_options": map[string]any{"include_usage": true}, "return_token_ids": true, "temperature": 0}
	if req.Model != "" {
		body["model"] = req.Model
	}
	if req.ConversationID != "" {
		switch req.Field {
		case ConversationFieldTop:
			body["conversation_id"] = req.ConversationID
		case ConversationFieldDisagg:
			body["disaggregated_params"] = map[string]any{"conversation_id": req.ConversationID}
		}
	}
	b, err := json.Marshal(body)
	if err != nil {
		return a, &RequestError{Kind: ErrorOther, Err: err}
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return a, &RequestError{Kind: ErrorOther, Err: err}
	}
	hreq.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.Do(hreq)
	if err != nil {
		return a, classify(ctx, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		kind := ErrorHTTP5xx
		if resp.StatusCode < 500 {
			kind = ErrorHTTP4xx
		}
		return a, &RequestError{Kind: kind, Err: fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))}
	}
	path := resp.Header.Get(PathHeader)
	a, err = readStream(resp.Body, start, time.Now)
	a.path = path
	if err != nil && ctx.Err() != nil {
		return a, classify(ctx, err)
	}
	return a, err
}

// PathHeader is the router's response header that names the path a
// request took under conditional disaggregation: PathLocal (prefilled on
// the generation worker, no KV moved) or PathDisaggregated (through a
// context worker). A response without it is counted as PathUnknown.
const PathHeader = "X-Kvxfer-Route"

// The path classes of a request (PathHeader).
const (
	PathLocal         = "local"
	PathDisaggregated = "disaggregated"
	PathUnknown       = "unknown"
)

// Where a conversation's id goes in each request of it
// (Options.ConversationField).
const (
	// ConversationFieldTop sends a top-level "conversation_id": servers
	// that do not know it ignore it.
	ConversationFieldTop = "conversation_id"
	// ConversationFieldDisagg sends disaggregated_params.conversation_id,
	// the field TensorRT-LLM's conversation router reads. kvxfer's router
	// reads it too (the only disaggregated_params field a client may set).
	ConversationFieldDisagg = "disaggregated_params"
	// ConversationFieldNone sends no id.
	ConversationFieldNone = "none"
)

// MaxEvent bounds one server-sent event line of a stream.
const MaxEvent = 4 << 20

// readStream reads a completion's server-sent events from body, timing
// each one with now against start: TTFT at the first event that carries
// token ids, an ITL sample at each later one, E2EL at [DONE]. It stops
// at [DONE], at an error event, at an event that does not decode, and at
// the body's end (incomplete).
func readStream(body io.Reader, start time.Time, now func() time.Time) (answer, error) {
	a := answer{usage: -1, cached: -1}
	var last time.Time
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), MaxEvent)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		t := now()
		if data == "[DONE]" {
			a.e2el = t.Sub(start)
			if len(a.ids) == 0 && a.usage <= 0 {
				return a, &RequestError{Kind: ErrorNoTokens, Err: errors.New("the stream completed without a token")}
			}
			return a, nil
		}
		var ev event
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			return a, &RequestError{Kind: ErrorBadEvent, Err: fmt.Errorf("event %.200q: %v", data, err)}
		}
		if ev.Error != nil {
			return a, &RequestError{Kind: ErrorEvent, Err: errors.New(ev.Error.Message)}
		}
		n := 0
		for _, ch := range ev.Choices {
			n += len(ch.TokenIDs)
			a.ids = append(a.ids, ch.TokenIDs...)
		}
		if n > 0 {
			if last.IsZero() {
				a.ttft = t.Sub(start)
			} else {
				a.itl = append(a.itl, t.Sub(last))
			}
			last = t
		}
		if ev.Usage != nil {
			a.usage = ev.Usage.CompletionTokens
			a.timing = ev.Usage.Timing
			if d := ev.Usage.Details; d != nil && d.CachedTokens != nil && *d.CachedTokens >= 0 { // a negative count is no count
				a.cached = *d.CachedTokens
			}
		}
	}
	if err := sc.Err(); err != nil {
		return a, &RequestError{Kind: ErrorIncomplete, Err: fmt.Errorf("reading the stream: %w", err)}
	}
	return a, &RequestError{Kind: ErrorIncomplete, Err: errors.New("the stream ended without [DONE]")}
}

// event is the part of a stream chunk that send reads.
type event struct {
	Choices []struct {
		TokenIDs []int32 `json:"token_ids"`
	} `json:"choices"`
	Usage *struct {
		CompletionTokens int     `json:"completion_tokens"`
		Timing           *Timing `json:"kvxfer_timing"`
		Details          *struct {
			CachedTokens *int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// RequestError is why a request failed, with its kind (one of the Error*
// constants).
type RequestError struct {
	Kind string
	Err  error
}

func (e *RequestError) Error() string { return "serving: request: " + e.Kind + ": " + e.Err.Error() }

func (e *RequestError) Unwrap() error { return e.Err }

// classify names the kind of a transport error.
func classify(ctx context.Context, err error) *RequestError {
	var op *net.OpError
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return &RequestError{Kind: ErrorTimeout, Err: err}
	case ctx.Err() != nil:
		return &RequestError{Kind: ErrorCanceled, Err: err}
	case errors.As(err, &op) && op.Op == "dial":
		return &RequestError{Kind: ErrorConnect, Err: err}
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		return &RequestError{Kind: ErrorIncomplete, Err: err}
	}
	return &RequestError{Kind: ErrorOther, Err: err}
}
