package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Migration: when a generation worker fails mid-request (its stream is cut
// by a read error, the chunk deadline or its connection lost; or the
// generation request fails before any output: an error after sending, or a
// 502 or 504 answer) the router sends the request again, as long as
// RouterOptions.MigrationLimit allows: a context phase again, on any
// context worker, with the prompt and the tokens the client has already
// been sent (ResumeField), then a generation phase on another generation
// worker (the failed one only if no other can be reached). The client's
// stream continues where it was cut: the reference engine is
// deterministic, so the whole stream is the one an uninterrupted request
// gives. To know which tokens the client has, the router asks streaming
// generation workers for return_token_ids (and takes the ids out of the
// chunks for a client that did not ask for them). A non-streaming request
// is sent again from the start: its client has seen nothing. A request
// that cannot migrate (the limit reached, no worker, a stream whose text
// came without token ids) ends as before: an error event and no [DONE]
// for a stream, a 502 or 504 error otherwise.

// retryable is a generation failure that migration may recover from.
type retryable struct {
	err error
	// event is the worker's own error event, when it sent one.
	event []byte
}

func (e *retryable) Error() string { return e.err.Error() }
func (e *retryable) Unwrap() error { return e.err }

// errStreamEnded: the stream ended without [DONE] in a way migration
// cannot help with (the worker sent a client error event, forwarded).
var errStreamEnded = errors.New("the generation worker ended the stream with an error")

// routeMigrating is route with migration on: a context phase and a
// generation phase per attempt, until one answers the client or the
// request cannot migrate.
func (r *Router) routeMigrating(w http.ResponseWriter, req *http.Request, path string, orig object, stream bool, ri *routeInfo) {
	ctx := req.Context()
	cs := newClientStream(w, path == "/v1/chat/completions")
	orig.get("return_token_ids", &cs.ids)
	var so streamOptions
	orig.get("stream_options", &so)
	cs.usage = so.IncludeUsage
	m := &migrating{r: r, w: w, cs: cs, path: path, orig: orig, stream: stream, ri: ri}
	for migrations := 0; ; migrations++ {
		var resume []int32
		if stream {
			resume = cs.seen
		}
		cr, out := r.runContext(ctx, path, orig, resume, ri)
		if cr == nil {
			m.contextEnded(out)
			return
		}
		if r.afterContext != nil {
			r.afterContext(ctx)
		}
		srv, fail := m.generate(ctx, cr, resume, migrations)
		if fail == nil {
			return
		}
		// The generation failed: migrate, or end the request.
		r.releaseContext(ctx, cr) // when it was never pulled
		if !m.mayMigrate(srv, fail, migrations) {
			return
		}
		m.avoid, m.moving = srv, true
	}
}

// migrating is what the attempts of one request routed with migration
// share.
type migrating struct {
	r      *Router
	w      http.ResponseWriter
	cs     *clientStream
	path   string
	orig   object
	stream bool
	ri     *routeInfo
	avoid  *upstream // the generation worker that failed last
	moving bool      // the attempt is a migration not yet taken over
}

// contextEnded answers the client when an attempt's context phase gave no
// context to generate from (its outcome out: an error, or the whole
// answer).
func (m *migrating) contextEnded(out *contextOutcome) {
	if m.moving && (out.err != nil || !out.finished) {
		m.r.m.Migrations.WithLabelValues("failed").Inc()
	}
	if !m.cs.started {
		m.r.writeOutcome(m.w, out, m.stream)
	} else {
		m.cs.contextOutcome(out)
	}
}

// generate runs an attempt's generation phase from the context cr (the
// tokens resume already sent to a streaming client). It returns the
// failure migration may recover from, and the worker that failed (nil
// when none could be reached); a nil failure: the request has ended
// (answered, refused, or its client gone), its context released.
func (m *migrating) generate(ctx context.Context, cr *contextResult, resume []int32, migrations int) (*upstream, *retryable) {
	r := m.r
	genReq := generationRequest(m.path, m.orig, cr)
	if m.stream {
		genReq.set("return_token_ids", true)
	}
	if len(resume) > 0 {
		genReq.set(ResumeField, resume)
	}
	resp, srv, err := r.post(ctx, r.gen, m.path, genReq, m.avoid, m.ri)
	switch {
	case err != nil:
		return srv, m.postFailed(ctx, cr, srv, err)
	case resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusGatewayTimeout:
		return srv, m.gatewayFailed(ctx, cr, srv, resp, migrations)
	case resp.StatusCode != http.StatusOK:
		m.refused(ctx, cr, resp)
		return srv, nil
	}
	if m.moving {
		m.moving = false
		r.m.Migrations.WithLabelValues("ok").Inc()
	}
	err = m.cs.answer(resp, m.stream)
	resp.Body.Close()
	return srv, m.answerFailed(ctx, cr, srv, err)
}

// postFailed handles a generation request that reached no answer (err):
// the failure migration may recover from, or nil when the request has
// ended (its ctx done, or no generation worker reachable).
func (m *migrating) postFailed(ctx context.Context, cr *contextResult, srv *upstream, err error) *retryable {
	r := m.r
	switch {
	case ctx.Err() != nil:
		r.releaseContext(ctx, cr)
		return nil
	case srv == nil:
		// No generation worker could be reached (post logged each):
		// nothing to migrate to.
		r.releaseContext(ctx, cr)
		if m.moving {
			r.migrationFailed(m.cs, srv, err, "no generation worker reachable")
		} else {
			upstreamFailed(m.w, err)
		}
		return nil
	}
	return &retryable{err: err}
}

// gatewayFailed handles a bad gateway or gateway timeout answer of the
// generation worker srv: the failure, while the request may still
// migrate; else nil, the worker's own answer relayed to the client.
func (m *migrating) gatewayFailed(ctx context.Context, cr *contextResult, srv *upstream, resp *http.Response, migrations int) *retryable {
	r := m.r
	b, _ := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
	resp.Body.Close()
	fail := &retryable{err: fmt.Errorf("generation server %s: %s: %s", srv.url, resp.Status, strings.TrimSpace(string(b)))}
	if m.cs.started || migrations < r.migration {
		return fail
	}
	// The worker's own answer says it best.
	r.releaseContext(ctx, cr)
	r.m.Migrations.WithLabelValues("failed").Inc()
	r.warn("migrate-failed:"+srv.url, "generation failed and the request cannot migrate: the client gets the error",
		"url", srv.url, "migrations", migrations, "limit", r.migration, "err", fail.err)
	copyHeaders(m.w, resp)
	m.w.WriteHeader(resp.StatusCode)
	m.w.Write(b)
	return nil
}

// refused ends the request with the generation worker's refusal resp,
// for a reason another worker would share (a bad request, a full queue,
// a refused transfer): no migration.
func (m *migrating) refused(ctx context.Context, cr *contextResult, resp *http.Response) {
	r, cs := m.r, m.cs
	r.releaseContext(ctx, cr)
	if m.moving {
		r.m.Migrations.WithLabelValues("failed").Inc()
	}
	if !cs.started {
		relay(m.w, resp, nil, streamCopy)
		return
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, MaxBody))
	resp.Body.Close()
	cs.errorBody(resp.StatusCode, b)
}

// answerFailed turns the end err of the answer from the generation worker
// srv into the failure migration may recover from, or nil when the
// request has ended; a worker that cut the stream without a word is
// marked down.
func (m *migrating) answerFailed(ctx context.Context, cr *contextResult, srv *upstream, err error) *retryable {
	r := m.r
	switch {
	case err == nil, errors.Is(err, errClientGone), errors.Is(err, errStreamEnded):
		return nil
	case ctx.Err() != nil:
		r.releaseContext(ctx, cr)
		return nil
	}
	var fail *retryable
	if !errors.As(err, &fail) {
		fail = &retryable{err: err}
	}
	if srv != nil && !errors.Is(err, errStalled) && fail.event == nil {
		// Cut without a word from the worker (it died, or its
		// connection was reset): stop routing to it now.
		r.markDown(r.gen, srv, "stream cut: "+err.Error())
	}
	return fail
}

// mayMigrate reports whether the request may migrate after its generation
// on srv failed (fail, at attempt migrations), saying so in the log; when
// it may not, it ends the request (migrationFailed).
func (m *migrating) mayMigrate(srv *upstream, fail *retryable, migrations int) bool {
	r, cs := m.r, m.cs
	why := ""
	switch {
	case migrations >= r.migration:
		why = fmt.Sprintf("the migration limit (%d) is reached", r.migration)
	case m.stream && cs.untracked:
		why = "the stream's text came without token ids: it cannot be resumed"
	case m.stream && cs.finished:
		why = "the stream was cut after its last chunk"
	}
	if why != "" {
		r.migrationFailed(cs, srv, fail, why)
		return false
	}
	r.warn("migrate:"+srv.url, "generation failed mid-request: migrating the request to another generation worker",
		"url", srv.url, "tokens_sent", len(cs.seen), "migration", migrations+1, "limit", r.migration, "err", fail.err)
	return true
}

// migrationFailed ends a request whose generation failed and cannot
// migrate: an error event for a started stream, else a 502 or 504.
func (r *Router) migrationFailed(cs *clientStream, srv *upstream, err error, why string) {
	url := ""
	if srv != nil {
		url = srv.url
	}
	r.m.Migrations.WithLabelValues("failed").Inc()
	r.warn("migrate-failed:"+url, "generation failed and the request cannot migrate: the client gets an error",
		"url", url, "why", why, "tokens_sent", len(cs.seen), "limit", r.migration, "err", err)
	var rt *retryable
	if cs.started && errors.As(err, &rt) && rt.event != nil {
		cs.write(rt.event)
		return
	}
	if !cs.started {
		upstreamFailed(cs.w, err)
		return
	}
	cs.errorEvent(err)
}

// clientStream is the router's answer to one client across migrations:
// whether it has started, and for a stream what the client has been sent.
type clientStream struct {
	w     http.ResponseWriter
	flush func()
	chat  bool
	ids   bool // the client asked for return_token_ids
	usage bool // the client asked for the usage chunk

	started   bool    // status and headers written
	seen      []int32 // the generated ids the client has been sent
	roleSent  bool    // a chat stream's role chunk
	finished  bool    // a chunk with a finish_reason was sent
	untracked bool    // text was sent without its token ids
	id        json.RawMessage
	created   json.RawMessage
}

func newClientStream(w http.ResponseWriter, chat bool) *clientStream {
	cs := &clientStream{w: w, chat: chat, flush: func() {}}
	if f, ok := w.(http.Flusher); ok {
		cs.flush = f.Flush
	}
	return cs
}

// answer relays a generation worker's 200 answer: a stream event by event
// (nil at [DONE]), any other answer whole once read to its end.
func (cs *clientStream) answer(resp *http.Response, stream bool) error {
	isSSE := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	if !stream || !isSSE {
		if cs.started {
			return &retryable{err: errors.New("the migrated generation worker did not stream")}
		}
		b, err := readUpstream(resp.Body)
		if err != nil {
			return &retryable{err: fmt.Errorf("reading the generation server's answer: %w", err)}
		}
		cs.start(resp)
		if _, err := cs.w.Write(b); err != nil {
			return errClientGone
		}
		return nil
	}
	cs.start(resp)
	return cs.relay(resp.Body)
}

func (cs *clientStream) start(resp *http.Response) {
	if cs.started {
		return
	}
	cs.started = true
	copyHeaders(cs.w, resp)
	cs.w.WriteHeader(http.StatusOK)
}

// write sends one event.
func (cs *clientStream) write(data []byte) bool {
	if _, err := fmt.Fprintf(cs.w, "data: %s\n\n", data); err != nil {
		return false
	}
	cs.flush()
	return true
}

// maxEventBytes bounds one event of a generation worker's stream.
const maxEventBytes = MaxBody

// relay copies a generation worker's event stream to the client, event by
// event, recording the token ids sent. It returns nil at [DONE],
// errClientGone, errStreamEnded, or why the stream was cut (a partial
// event at the cut is dropped).
func (cs *clientStream) relay(body io.Reader) error {
	br := bufio.NewReaderSize(body, 32<<10)
	for {
		line, err := readLine(br)
		if err != nil {
			if err == io.EOF {
				err = errors.New("the stream ended without [DONE]")
			}
			return err
		}
		data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			if !cs.write(data) {
				return errClientGone
			}
			// Read the answer's end so that the connection is reused.
			io.Copy(io.Discard, io.LimitReader(br, 4<<10))
			return nil
		}
		out, err := cs.event(data)
		if err != nil {
			return err
		}
		if out != nil && !cs.write(out) {
			return errClientGone
		}
	}
}

// readLine reads one line, at most maxEventBytes long; a line the stream
// ends in the middle of is an error.
func readLine(br *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		frag, err := br.ReadSlice('\n')
		line = append(line, frag...)
		switch {
		case err == bufio.ErrBufferFull && len(line) <= maxEventBytes:
			continue
		case err == bufio.ErrBufferFull:
			return nil, fmt.Errorf("an event of more than %d bytes", maxEventBytes)
		}
		return line, err
	}
}

// event turns one of the worker's events into the client's (nil: none),
// recording what it carries. An error event the migration may recover
// from is returned as a *retryable; any other is forwarded and ends the
// stream (errStreamEnded).
func (cs *clientStream) event(data []byte) ([]byte, error) {
	var o object
	if json.Unmarshal(data, &o) != nil || o == nil {
		cs.untracked = true
		return data, nil
	}
	if raw, ok := o["error"]; ok {
		return nil, cs.workerError(raw, data)
	}
	changed := cs.sameIDs(o)
	var choices []object
	if _, err := o.get("choices", &choices); err != nil {
		cs.untracked = true
		return data, nil
	}
	for _, ch := range choices {
		drop, chChanged := cs.choice(ch)
		if drop {
			return nil, nil // a migrated stream's role chunk: the client has it
		}
		changed = changed || chChanged
	}
	if !changed {
		return data, nil
	}
	if len(choices) > 0 {
		o.set("choices", choices)
	}
	b, err := json.Marshal(o)
	if err != nil {
		return data, nil
	}
	return b, nil
}

// workerError is what event returns for the worker's error event data,
// whose error field is raw: a *retryable for a server error, else the
// event forwarded and errStreamEnded (errClientGone when the client is).
func (cs *clientStream) workerError(raw, data []byte) error {
	var e struct {
		Message string `json:"message"`
		Code    int    `json:"code"`
	}
	json.Unmarshal(raw, &e)
	if e.Code >= 500 {
		return &retryable{err: fmt.Errorf("the generation worker's error event: %s (%d)", e.Message, e.Code), event: data}
	}
	if !cs.write(data) {
		return errClientGone
	}
	return errStreamEnded
}

// sameIDs gives event o the id and creation time of the stream's first
// event, so that the client sees one across the workers of the stream;
// it reports whether o changed.
func (cs *clientStream) sameIDs(o object) bool {
	changed := false
	for _, k := range []string{"id", "created"} {
		v, ok := o[k]
		if !ok {
			continue
		}
		keep := &cs.id
		if k == "created" {
			keep = &cs.created
		}
		switch {
		case *keep == nil:
			*keep = v
		case !bytes.Equal(*keep, v):
			o[k] = *keep
			changed = true
		}
	}
	return changed
}

// choice records what one choice of an event carries (its token ids,
// whether it finished, whether the role is sent) and drops the token ids
// the client did not ask for. drop: the choice is a role chunk the client
// already has, and the event is not forwarded; changed: ch changed.
func (cs *clientStream) choice(ch object) (drop, changed bool) {
	var ids []int32
	hasIDs, _ := ch.get("token_ids", &ids)
	cs.seen = append(cs.seen, ids...)
	var text string
	var fr *string
	ch.get("finish_reason", &fr)
	if fr != nil {
		cs.finished = true
	}
	if cs.chat {
		var delta struct {
			Role    *string `json:"role"`
			Content string  `json:"content"`
		}
		ch.get("delta", &delta)
		if delta.Role != nil && delta.Content == "" && fr == nil && len(ids) == 0 {
			if cs.roleSent {
				return true, false
			}
			cs.roleSent = true
		}
		text = delta.Content
	} else {
		ch.get("text", &text)
	}
	if text != "" && !hasIDs {
		cs.untracked = true
	}
	if hasIDs && !cs.ids {
		delete(ch, "token_ids")
		changed = true
	}
	return false, changed
}

// contextOutcome ends a started stream with a migration's context phase
// outcome: an answer that finished there becomes its last chunk, usage and
// [DONE]; an error becomes an error event.
func (cs *clientStream) contextOutcome(o *contextOutcome) {
	switch {
	case o.err != nil:
		cs.errorEvent(o.err)
	case !o.finished:
		cs.errorBody(o.resp.StatusCode, o.body)
	default:
		cs.finishedChunks(o.body)
	}
}

// finishedChunks sends a context phase's answer that finished (a migrated
// request whose next token ended it) as the stream's last chunk, then its
// usage when asked, then [DONE].
func (cs *clientStream) finishedChunks(body []byte) {
	var a struct {
		Model   json.RawMessage `json:"model"`
		Choices []struct {
			Text         string                   `json:"text"`
			Message      struct{ Content string } `json:"message"`
			FinishReason json.RawMessage          `json:"finish_reason"`
			TokenIDs     []int32                  `json:"token_ids"`
		} `json:"choices"`
		Usage json.RawMessage `json:"usage"`
	}
	if err := json.Unmarshal(body, &a); err != nil || len(a.Choices) == 0 {
		cs.errorEvent(errors.New("the context server's answer has no choices"))
		return
	}
	c := a.Choices[0]
	choice := map[string]any{"index": 0, "finish_reason": c.FinishReason, "logprobs": nil}
	object := "text_completion"
	if cs.chat {
		object = "chat.completion.chunk"
		choice["delta"] = map[string]any{"content": c.Message.Content}
	} else {
		choice["text"] = c.Text
	}
	if cs.ids {
		choice["token_ids"] = append([]int32{}, c.TokenIDs...)
	}
	chunk := map[string]any{"id": cs.id, "object": object, "created": cs.created, "model": a.Model, "choices": []any{choice}}
	b, _ := json.Marshal(chunk)
	if !cs.write(b) {
		return
	}
	if cs.usage {
		b, _ = json.Marshal(map[string]any{"id": cs.id, "object": object, "created": cs.created, "model": a.Model, "choices": []any{}, "usage": a.Usage})
		if !cs.write(b) {
			return
		}
	}
	cs.write([]byte("[DONE]"))
}

// errorBody ends a started stream with a worker's error answer as an
// error event.
func (cs *clientStream) errorBody(code int, body []byte) {
	var e APIError
	if json.Unmarshal(body, &e) != nil || e.Error.Message == "" {
		e.Error.Message, e.Error.Type = strings.TrimSpace(string(body)), "upstream_error"
	}
	if e.Error.Code == 0 {
		e.Error.Code = code
	}
	b, _ := json.Marshal(e)
	cs.write(b)
}

// errorEvent ends a started stream with an OpenAI-style error event (no
// [DONE]): 504 when a worker missed a deadline, else 502.
func (cs *clientStream) errorEvent(err error) {
	var e APIError
	e.Error.Message = "the generation worker's stream was cut: " + err.Error()
	e.Error.Type, e.Error.Code = "upstream_error", http.StatusBadGateway
	if errors.Is(err, errStalled) {
		e.Error.Type, e.Error.Code = "upstream_timeout", http.StatusGatewayTimeout
	}
	b, _ := json.Marshal(e)
	cs.write(b)
}
