package serve

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/metrics"
)

// Defaults of HTTPLimits. A worker's clients are routers (one connection
// per request in flight, so the per-host bound is a router's concurrency
// against one worker) and the odd direct client; a router's are users.
const (
	DefaultHTTPMaxConns          = 4096
	DefaultHTTPMaxConnsPerHost   = 1024
	DefaultHTTPIdleTimeout       = 2 * time.Minute
	DefaultHTTPReadHeaderTimeout = 10 * time.Second
	DefaultHTTPWriteTimeout      = 30 * time.Second
	DefaultHTTPBodyTimeout       = time.Minute
	DefaultHTTPBodyBudget        = 256 << 20
)

// FreeBodyBytes is how much of each request body is read without
// BodyBudget: requests of the usual size are never refused for it.
const FreeBodyBytes = 64 << 10

// MaxHeaderBytes bounds a request's header lines (and its request line),
// which the server keeps until the headers end; past it the request is
// answered 431 and its connection closed. net/http's own default, 1 MiB,
// let each of MaxConns connections that never ends its headers hold a
// megabyte for ReadHeaderTimeout; an OpenAI client's headers, or the
// router's to a worker, are a few hundred bytes.
const MaxHeaderBytes = 64 << 10

// HTTPLimits bound the connections of a worker's or router's HTTP server. A
// zero field takes its default; a negative one removes the bound.
type HTTPLimits struct {
	// MaxConns bounds the open connections (active or idle keep-alive);
	// one more is closed at once.
	MaxConns int
	// MaxConnsPerHost bounds those from one client IP address.
	MaxConnsPerHost int
	// IdleTimeout closes a keep-alive connection idle this long.
	IdleTimeout time.Duration
	// ReadHeaderTimeout bounds the reading of a request's headers.
	ReadHeaderTimeout time.Duration
	// WriteTimeout bounds each write of an answer (each event of a
	// stream, each flush): a client that takes no more bytes for this long
	// (it stopped reading, or went away without a word) has its connection
	// closed, which ends its request and what the request holds upstream.
	// Unlike http.Server.WriteTimeout it bounds one write, not the whole
	// answer, so a stream may last as long as it produces.
	WriteTimeout time.Duration
	// BodyTimeout bounds the reading of a request's body, from the end of
	// its headers (which ReadHeaderTimeout bounds): a client that sends it
	// slower has its request answered 408 and its connection closed.
	BodyTimeout time.Duration
	// BodyBudget bounds the bytes of request bodies being received, past
	// each body's first FreeBodyBytes, summed over the server's
	// connections: a body that would go over it is answered 503. A body's
	// bytes count from their arrival until it has all come or failed.
	// Without it each of MaxConns connections may hold a body of up to
	// MaxBody for BodyTimeout.
	BodyBudget int64
}

// WithDefaults returns l with zero fields set to their defaults.
func (l HTTPLimits) WithDefaults() HTTPLimits {
	if l.MaxConns == 0 {
		l.MaxConns = DefaultHTTPMaxConns
	}
	if l.MaxConnsPerHost == 0 {
		l.MaxConnsPerHost = DefaultHTTPMaxConnsPerHost
	}
	if l.IdleTimeout == 0 {
		l.IdleTimeout = DefaultHTTPIdleTimeout
	}
	if l.ReadHeaderTimeout == 0 {
		l.ReadHeaderTimeout = DefaultHTTPReadHeaderTimeout
	}
	if l.WriteTimeout == 0 {
		l.WriteTimeout = DefaultHTTPWriteTimeout
	}
	if l.BodyTimeout == 0 {
		l.BodyTimeout = DefaultHTTPBodyTimeout
	}
	if l.BodyBudget == 0 {
		l.BodyBudget = DefaultHTTPBodyBudget
	}
	return l
}

// String describes l for logs: "max 4096 connections, 1024 per host, idle
// timeout 2m0s, write timeout 30s, body timeout 1m0s, body budget 268435456
// bytes".
func (l HTTPLimits) String() string {
	return netlimit.Limits{MaxConns: l.MaxConns, MaxConnsPerHost: l.MaxConnsPerHost}.String() + ", idle timeout " + l.IdleTimeout.String() +
		", write timeout " + l.WriteTimeout.String() + ", body timeout " + l.BodyTimeout.String() +
		", body budget " + strconv.FormatInt(l.BodyBudget, 10) + " bytes"
}

// NewHTTPServer returns a server of h with the timeouts of lim (after
// WithDefaults). Serve it on a listener from LimitListener.
func NewHTTPServer(h http.Handler, lim HTTPLimits) *http.Server {
	lim = lim.WithDefaults()
	if lim.WriteTimeout > 0 {
		h = writeDeadlines(h, lim.WriteTimeout)
	}
	if lim.BodyTimeout > 0 {
		h = bodyDeadline(h, lim.BodyTimeout)
	}
	if lim.BodyBudget > 0 {
		h = bodyBudget(h, &budget{max: lim.BodyBudget, left: lim.BodyBudget})
	}
	return &http.Server{Handler: h, ReadHeaderTimeout: max(0, lim.ReadHeaderTimeout), IdleTimeout: max(0, lim.IdleTimeout),
		MaxHeaderBytes: MaxHeaderBytes}
}

// writeDeadlines gives each write and flush of h's answers d to complete
// (HTTPLimits.WriteTimeout). A write that misses it fails, the handler
// sees its client gone, and the server closes the connection.
func writeDeadlines(h http.Handler, d time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		// None while the handler works before its first write: the
		// connection may carry the deadline of its previous answer.
		rc.SetWriteDeadline(time.Time{})
		h.ServeHTTP(&deadlineWriter{ResponseWriter: w, rc: rc, d: d}, r)
		// The server writes what the handler left buffered after it
		// returns.
		rc.SetWriteDeadline(time.Now().Add(d))
	})
}

// bodyDeadline gives a request's body d to arrive (HTTPLimits.BodyTimeout).
// http.Server.ReadTimeout would do it for the body, but it stays on the
// connection while the handler runs, and a stream that outlived it would
// be cancelled as if its client had gone.
func bodyDeadline(h http.Handler, d time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		rc.SetReadDeadline(time.Now().Add(d))
		r.Body = &deadlineBody{ReadCloser: r.Body, rc: rc}
		h.ServeHTTP(w, r)
	})
}

// errBodyBudget: a request body would take the server's bodies being
// received past HTTPLimits.BodyBudget.
var errBodyBudget = errors.New("the request bodies being received take the server's limit")

// budget is a server's HTTPLimits.BodyBudget: the bytes left to bodies
// being received. Safe for concurrent use.
type budget struct {
	max  int64
	mu   sync.Mutex
	left int64
}

func (b *budget) take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n > b.left {
		return false
	}
	b.left -= n
	return true
}

func (b *budget) give(n int64) {
	b.mu.Lock()
	b.left += n
	b.mu.Unlock()
}

// bodyBudget makes each request body past its first FreeBodyBytes take its
// bytes from b as they arrive, and give them back once it has all come (or
// failed, or the handler returned): a slow body holds its share of b, not
// of the process's memory. A body that would go over b fails with
// errBodyBudget.
func bodyBudget(h http.Handler, b *budget) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		bb := &budgetBody{ReadCloser: r.Body, b: b, free: FreeBodyBytes}
		r.Body = bb
		defer bb.end()
		h.ServeHTTP(w, r)
	})
}

// budgetBody is a request body that takes its bytes past free from b.
type budgetBody struct {
	io.ReadCloser
	b    *budget
	free int64 // bytes still to come without the budget
	held int64 // taken from b
	err  error // the body's end, once it came
}

// budgetChunk is the most a read of a body past its free bytes takes from
// the budget at once (and reads).
const budgetChunk = 64 << 10

func (r *budgetBody) Read(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	if r.free > 0 {
		n, err := r.ReadCloser.Read(p[:min(int64(len(p)), r.free)])
		r.free -= int64(n)
		r.err = err
		return n, err
	}
	// Take from the budget before reading, so that nothing is read that
	// it does not cover; give back what did not come.
	p = p[:min(len(p), budgetChunk)]
	if !r.b.take(int64(len(p))) {
		r.end()
		r.err = fmt.Errorf("%w (%d bytes past the first %d of each body)", errBodyBudget, r.b.max, FreeBodyBytes)
		return 0, r.err
	}
	n, err := r.ReadCloser.Read(p)
	r.b.give(int64(len(p) - n))
	r.held += int64(n)
	if err != nil {
		r.err = err
		r.end()
	}
	return n, err
}

// end gives back what the body took; a body that has all come is in the
// handler's hands, bounded by the server's work on it from there.
func (r *budgetBody) end() {
	if r.held > 0 {
		r.b.give(r.held)
		r.held = 0
	}
}

// deadlineBody lifts the read deadline when the body ends: from there on
// the server reads the connection only to learn that the client left. A
// body that failed keeps it: the server reads what is left of it before
// answering, and must not wait for a client that stopped sending.
type deadlineBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	done bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF && !b.done {
		b.done = true
		b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

// deadlineWriter sets the write deadline before each write and flush.
type deadlineWriter struct {
	http.ResponseWriter
	rc *http.ResponseController
	d  time.Duration
}

func (w *deadlineWriter) Write(b []byte) (int, error) {
	w.rc.SetWriteDeadline(time.Now().Add(w.d))
	return w.ResponseWriter.Write(b)
}

func (w *deadlineWriter) Flush() {
	w.rc.SetWriteDeadline(time.Now().Add(w.d))
	w.rc.Flush()
}

// Unwrap lets http.ResponseController reach the server's writer.
func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// LimitListener wraps ln so that it keeps at most lim's connections (after
// WithDefaults), refusing the excess at once with a rate-limited log line
// on log. name says which server it is in logs; conns, when not nil,
// counts its connections (kvxfer_connections_*{listener="http"}).
func LimitListener(ln net.Listener, name string, lim HTTPLimits, log *slog.Logger, conns *metrics.Conns) net.Listener {
	lim = lim.WithDefaults()
	var obs netlimit.Observer
	if conns != nil {
		obs = conns.Listener(metrics.ListenerHTTP)
	}
	return netlimit.NewListener(ln, name, netlimit.Limits{MaxConns: lim.MaxConns, MaxConnsPerHost: lim.MaxConnsPerHost}, log, obs)
}
