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

// StreamCompletion posts body, a streaming completion request, to the
// /v1/completions of base (a worker or a router) through c, and returns the
// text of the stream and the time to its first text. An answer other than
// 200, an error event, an event that does not decode and a stream that ends
// without [DONE] are errors.
func StreamCompletion(ctx context.Context, c *http.Client, base string, body map[string]any) (string, time.Duration, error) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return "", 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return "", 0, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	var text strings.Builder
	var ttft time.Duration
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
				Text string `json:"text"`
			} `json:"choices"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return "", 0, fmt.Errorf("bad event %q: %v", data, err)
		}
		if ch.Error != nil {
			return "", 0, fmt.Errorf("error event: %s", ch.Error.Message)
		}
		for _, c := range ch.Choices {
			if c.Text != "" && ttft == 0 {
				ttft = time.Since(start)
			}
			text.WriteString(c.Text)
		}
	}
	if !done {
		return "", 0, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
	}
	return text.String(), ttft, nil
}
