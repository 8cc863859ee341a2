package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// StreamResult is a streamed completion, collected.
type StreamResult struct {
	Text string
	// TokenIDs are the generated ids, when the request set return_token_ids.
	TokenIDs []int32
	// FinishReason is the last finish_reason the stream carried.
	FinishReason string
	// CompletionTokens is usage.completion_tokens, when the stream carried
	// a usage chunk (stream_options.include_usage).
	CompletionTokens int
	// TTFT is the time from the request to its first text.
	TTFT time.Duration
}

// StreamCompletion posts body, a streaming completion request, to the
// /v1/completions of base (a worker or a router) through c, and returns the
// stream collected. An answer other than 200, an error event, an event that
// does not decode and a stream that ends without [DONE] are errors.
func StreamCompletion(ctx context.Context, c *http.Client, base string, body map[string]any) (StreamResult, error) {
	var res StreamResult
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return res, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return res, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return res, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	done := false
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		data := strings.TrimPrefix(line, "data: ")
		if data == "[DONE]" {
			done = true
			break
		}
		var ch struct {
			Choices []struct {
				Text         string  `json:"text"`
				TokenIDs     []int32 `json:"token_ids"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return res, fmt.Errorf("bad event %q: %v", data, err)
		}
		if ch.Error != nil {
			return res, fmt.Errorf("error event: %s", ch.Error.Message)
		}
		for _, c := range ch.Choices {
			if c.Text != "" && res.TTFT == 0 {
				res.TTFT = time.Since(start)
			}
			text.WriteString(c.Text)
			res.TokenIDs = append(res.TokenIDs, c.TokenIDs...)
			if c.FinishReason != nil {
				res.FinishReason = *c.FinishReason
			}
		}
		if ch.Usage != nil {
			res.CompletionTokens = ch.Usage.CompletionTokens
		}
	}
	if !done {
		return res, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
	}
	res.Text = text.String()
	return res, nil
}
