package serve

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// APIError is the body of every error answer, in OpenAI's shape.
type APIError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, code int, typ, msg string) {
	var e APIError
	e.Error.Message, e.Error.Type, e.Error.Code = msg, typ, code
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(e)
}

// readBody reads a request's body: 413 when it is over MaxBody, 408 when it
// did not come within HTTPLimits.BodyTimeout, 400 when it cannot be read.
func readBody(req *http.Request) ([]byte, *httpError) {
	b, err := readAll(http.MaxBytesReader(nil, req.Body, MaxBody))
	var tooLarge *http.MaxBytesError
	var timeout net.Error
	switch {
	case errors.As(err, &tooLarge):
		return nil, &httpError{http.StatusRequestEntityTooLarge, "request_too_large",
			fmt.Sprintf("the request body is over %d bytes (MaxBody)", MaxBody)}
	case errors.Is(err, errBodyBudget):
		return nil, &httpError{http.StatusServiceUnavailable, "server_busy", err.Error() + ": try again"}
	case errors.As(err, &timeout) && timeout.Timeout():
		return nil, &httpError{http.StatusRequestTimeout, "request_timeout", "the request body did not come in time: " + err.Error()}
	case err != nil:
		return nil, badRequest("reading the request body: %v", err)
	}
	return b, nil
}

// readAll is io.ReadAll for a request body: past its first budgetChunk
// bytes it keeps what has come in chunks of budgetChunk bytes, each made
// when the one before is full, and joins them into one slice when the body
// has all come. A body still coming then holds about the bytes it has sent,
// those HTTPLimits.BodyBudget covers, where io.ReadAll (Go 1.26) holds up
// to half as much again, in a chunk made for what is still to come. Like
// io.ReadAll's, the join briefly holds the body twice.
func readAll(r io.Reader) ([]byte, error) {
	var full [][]byte
	b := make([]byte, 0, 512)
	for {
		if len(b) == cap(b) {
			if cap(b) < budgetChunk {
				b = append(b, 0)[:len(b)]
			} else {
				full = append(full, b)
				b = make([]byte, 0, budgetChunk)
			}
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	if len(full) == 0 {
		return b, nil
	}
	size := len(b)
	for _, c := range full {
		size += len(c)
	}
	out := make([]byte, 0, size)
	for i, c := range full {
		out = append(out, c...)
		full[i] = nil // the next collection may take it
	}
	return append(out, b...), nil
}

func copyHeaders(w http.ResponseWriter, resp *http.Response) {
	for _, k := range []string{"Content-Type", "Cache-Control", "X-Kvxfer-Timing"} {
		if v := resp.Header.Get(k); v != "" {
			w.Header().Set(k, v)
		}
	}
}

// errClientGone: writing to the client failed.
var errClientGone = errors.New("client gone")

// flushCopyErr copies a (possibly streamed) body, flushing after every read
// so server-sent events reach the client as they come, and returns why it
// stopped: nil at the body's end, errClientGone when the client cannot be
// written to, else the body's read error.
func flushCopyErr(w http.ResponseWriter, r io.Reader) error {
	f, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return errClientGone
			}
			if f != nil {
				f.Flush()
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// statusRecorder remembers the status code for metrics.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.code == 0 {
		s.code = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusRecorder) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// countCodes counts requests by route pattern and status code.
func countCodes(next *http.ServeMux, c *prometheus.CounterVec) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, req)
		_, pattern := next.Handler(req)
		if pattern == "" || pattern == "/" {
			pattern = "other"
		}
		if rec.code == 0 {
			rec.code = http.StatusOK
		}
		c.WithLabelValues(pattern, strconv.Itoa(rec.code)).Inc()
	})
}
