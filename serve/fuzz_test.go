package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// fuzzDeadline bounds one fuzzed request: a body may ask for up to 65,536
// tokens, which the tiny model takes seconds to write. A request cut short
// by it is the client going away, and only its status is then free.
const fuzzDeadline = 250 * time.Millisecond

// checkAnswer checks what a handler wrote for a fuzzed request: 200 with a
// completion (an object with one choice, or a stream of data lines ending
// in [DONE]; any JSON on a route that is not a completion's), or an error object whose message and type say what was
// wrong, with a status of 4xx unless the request's context ended first.
// Anything else (a 5xx for a request the client got wrong, an empty
// message, a status without an error body) is a defect.
func checkAnswer(t *testing.T, rec *httptest.ResponseRecorder, ctxErr error, body []byte, completion bool) {
	t.Helper()
	out := rec.Body.Bytes()
	if rec.Code == http.StatusOK {
		if ctxErr != nil {
			return // a stream cut short by the deadline
		}
		if !completion {
			if !json.Valid(out) {
				t.Fatalf("body %q: 200 with %q, not JSON", body, tail(out))
			}
			return
		}
		if bytes.HasPrefix(out, []byte("data: ")) {
			if !bytes.HasSuffix(out, []byte("data: [DONE]\n\n")) {
				t.Fatalf("body %q: a 200 stream that does not end with [DONE]: %q", body, tail(out))
			}
			return
		}
		var ans struct {
			Choices []json.RawMessage `json:"choices"`
		}
		if err := json.Unmarshal(out, &ans); err != nil || len(ans.Choices) != 1 {
			t.Fatalf("body %q: 200 with %q (err %v), want a completion with one choice", body, tail(out), err)
		}
		return
	}
	var e APIError
	if err := json.Unmarshal(out, &e); err != nil {
		t.Fatalf("body %q: status %d with %q, not an error object: %v", body, rec.Code, tail(out), err)
	}
	if e.Error.Message == "" || e.Error.Type == "" || e.Error.Code != rec.Code {
		t.Fatalf("body %q: status %d with error %+v: want a message, a type and the status", body, rec.Code, e.Error)
	}
	if ctxErr == nil && (rec.Code < 400 || rec.Code >= 500) {
		t.Fatalf("body %q: status %d (%s: %s) for a request that had all the time it needed; want 200 or 4xx",
			body, rec.Code, e.Error.Type, e.Error.Message)
	}
}

func tail(b []byte) []byte {
	if len(b) > 300 {
		return b[len(b)-300:]
	}
	return b
}

// workerRoutes are the worker's routes that decode what a client sends:
// the body, or for the KV event feed the query.
var workerRoutes = []struct{ method, path string }{
	{http.MethodPost, "/v1/completions"},
	{http.MethodPost, "/v1/chat/completions"},
	{http.MethodPost, CancelContextPath},
	{http.MethodPost, CachedPrefixPath},
	{http.MethodGet, KVEventsPath},
}

// FuzzWorkerRequest sends arbitrary bodies to a worker's routes that
// decode one (and arbitrary queries to its KV event feed), which every
// client of the HTTP API reaches: whatever it sends, the answer is a
// completion (a JSON answer on the other routes) or an error that says what
// is wrong (4xx, never a 5xx), and the worker goes on serving.
func FuzzWorkerRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"tiny-gqa","prompt":"hello","max_tokens":2}`,
		`{"prompt":[1,2,3],"max_tokens":1,"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":"hi","stop":["a","b"],"temperature":0.7,"seed":3,"return_token_ids":true}`,
		`{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3}`,
		`{"prompt_token_ids":[5,6,-1],"max_tokens":2}`,
		`{"prompt":"x","disaggregated_params":{"request_type":"generation_only","ctx_request_id":1,"encoded_opaque_state":"AA=="}}`,
		`{"prompt":"x","kvxfer_resume_token_ids":[1,2],"cache_salt":"s","n":1,"ignore_eos":true,"max_tokens":3}`,
		`{"ctx_request_id":1,"encoded_opaque_state":"AAEC"}`,
		`{"prompt":"x","max_tokens":0}`, `[]`, `null`, `{"prompt":null}`, `{"prompt":"a"} x`,
		`after=3&limit=2`, `limit=0`, `after=x`,
	} {
		for r := range workerRoutes {
			f.Add([]byte(s), uint8(r))
		}
	}
	w, err := NewWorker(context.Background(), WorkerOptions{Role: RoleBoth, Model: "tiny-gqa"})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { w.Close() })
	h := w.Handler()
	f.Fuzz(func(t *testing.T, body []byte, route uint8) {
		rt := workerRoutes[int(route)%len(workerRoutes)]
		ctx, cancel := context.WithTimeout(context.Background(), fuzzDeadline)
		defer cancel()
		target, in := rt.path, io.Reader(bytes.NewReader(body))
		if rt.method == http.MethodGet {
			target, in = rt.path+"?"+string(body), nil
		}
		req, err := http.NewRequestWithContext(ctx, rt.method, target, in)
		if err != nil {
			return // not a URL: no request reaches the worker
		}
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		completion := rt.path == "/v1/completions" || rt.path == "/v1/chat/completions"
		checkAnswer(t, rec, ctx.Err(), body, completion)
	})
}

// fuzzUpstream is a stand-in worker whose answers the fuzzer writes.
type fuzzUpstream struct {
	mu     sync.Mutex
	status int
	body   []byte
	srv    *httptest.Server
}

func newFuzzUpstream(f *testing.F) *fuzzUpstream {
	u := &fuzzUpstream{status: http.StatusOK}
	u.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/completions", "/v1/chat/completions":
		case "/health":
			// A worker the router marked down comes back, so that later
			// inputs still reach the parsing of the workers' answers.
			return
		default:
			http.NotFound(rw, r)
			return
		}
		u.mu.Lock()
		status, body := u.status, u.body
		u.mu.Unlock()
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(status)
		rw.Write(body)
	}))
	f.Cleanup(u.srv.Close)
	return u
}

func (u *fuzzUpstream) answer(status int, body []byte) {
	u.mu.Lock()
	u.status, u.body = status, body
	u.mu.Unlock()
}

// FuzzRouterRequest sends arbitrary bodies to a router whose context and
// generation workers answer what the fuzzer writes: the router parses the
// client's body, the context worker's answer (its disaggregated_params and
// prompt token ids) and builds the generation request from them. Whatever
// they are, the client gets the generation worker's answer, the context
// worker's own error, or an error object from the router that says what
// went wrong, and the router goes on routing.
func FuzzRouterRequest(f *testing.F) {
	ctxAns := `{"choices":[{"text":"a","finish_reason":"length","disaggregated_params":{"request_type":"context_only","ctx_request_id":7,"encoded_opaque_state":"AAEC","first_gen_tokens":[3]}}],"prompt_token_ids":[1,2,3]}`
	genAns := `{"choices":[{"text":"ab","finish_reason":"length"}]}`
	for _, s := range []struct {
		req, ctx, gen string
		status        uint16
	}{
		{`{"model":"tiny-gqa","prompt":"hello","max_tokens":2}`, ctxAns, genAns, 200},
		{`{"prompt":"hello","stream":true}`, ctxAns, "data: {}\n\ndata: [DONE]\n\n", 200},
		{`{"messages":[{"role":"user","content":"hi"}],"conversation_id":"c1"}`, ctxAns, genAns, 200},
		{`{"prompt":"hello"}`, `{"choices":[{"finish_reason":"stop","text":"x"}]}`, genAns, 200},
		{`{"prompt":"hello","stream":true}`, `{"choices":[{"finish_reason":"stop","message":{"content":"x"}}]}`, genAns, 200},
		{`{"prompt":"hello"}`, `{"error":{"message":"no","type":"x","code":400}}`, genAns, 400},
		{`{"prompt":"hello"}`, `{"choices":[]}`, genAns, 200},
		{`{"Cache_Salt":"x","prompt":"a"}`, ctxAns, genAns, 200},
		{`{"prompt":"a","kvxfer_resume_token_ids":[1]}`, ctxAns, genAns, 200},
		{`null`, ctxAns, genAns, 200},
	} {
		f.Add([]byte(s.req), []byte(s.ctx), []byte(s.gen), s.status)
	}
	ctxW, genW := newFuzzUpstream(f), newFuzzUpstream(f)
	r, err := NewRouter(RouterOptions{Context: []string{ctxW.srv.URL}, Generation: []string{genW.srv.URL},
		ContextPolicy: "kv_cache_aware", MigrationLimit: MigrationOff})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(r.Close)
	h := r.Handler()
	f.Fuzz(func(t *testing.T, body, ctxBody, genBody []byte, status uint16) {
		st := int(status)
		if st < 200 || st > 599 {
			st = http.StatusOK
		}
		ctxW.answer(st, ctxBody)
		genW.answer(http.StatusOK, genBody)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/completions", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		out := rec.Body.Bytes()
		switch {
		case ctx.Err() != nil:
			t.Fatalf("request %q, context answer %d %q: the router took over 5 s", body, st, ctxBody)
		case rec.Code == http.StatusOK:
			// The generation worker's answer, or the context worker's
			// finished one (possibly as one stream chunk).
		case rec.Code == st && bytes.Equal(out, ctxBody):
			// The context worker's own answer, relayed.
		default:
			var e APIError
			if err := json.Unmarshal(out, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("request %q, context answer %d %q: status %d with %q: want an error object with a message and a type (err %v)",
					body, st, ctxBody, rec.Code, tail(out), err)
			}
			if !strings.Contains(e.Error.Message, " ") {
				t.Fatalf("request %q: error message %q says nothing", body, e.Error.Message)
			}
		}
	})
}
