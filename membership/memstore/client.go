package memstore

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/membership"
)

// ClientOptions are a Client's settings.
type ClientOptions struct {
	// HTTPClient makes the calls; nil: a client of its own, whose idle
	// connections Close releases. Give one with a TLS config for https.
	HTTPClient *http.Client
	// Token is the bearer token the Handler wants, if any.
	Token string
	// PollWait is how long one watch poll waits on the server (default
	// 10 s, at most MaxWait).
	PollWait time.Duration
}

// Client reaches a Store served by Handler; it implements
// membership.Store. NewClient starts no goroutine and dials nothing; each
// call is one HTTP request bounded by its ctx and by Close, which ends the
// calls under way (a watcher's long poll among them).
type Client struct {
	base string
	hc   *http.Client
	own  bool
	opts ClientOptions
	life context.Context // canceled by Close
	end  context.CancelFunc

	mu     sync.Mutex
	closed bool
}

// maxResponseBody bounds an answer: a list of the most keys a store
// holds, base64 and JSON included, with room to spare.
const maxResponseBody = 64 << 20

// NewClient returns a client of the store served at base
// (http(s)://host:port, without BasePath).
func NewClient(base string, opts ClientOptions) (*Client, error) {
	if !strings.HasPrefix(base, "http://") && !strings.HasPrefix(base, "https://") {
		return nil, fmt.Errorf("%w: store url %q: want http(s)://host:port", membership.ErrInvalid, clipName(base))
	}
	c := &Client{base: strings.TrimSuffix(base, "/") + BasePath + "/", hc: opts.HTTPClient, opts: opts}
	c.life, c.end = context.WithCancel(context.Background())
	if c.hc == nil {
		c.hc, c.own = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}, true
	}
	if c.opts.PollWait <= 0 {
		c.opts.PollWait = 10 * time.Second
	}
	c.opts.PollWait = min(c.opts.PollWait, MaxWait)
	return c, nil
}

var _ membership.Store = (*Client)(nil)

// call posts req to name and decodes the answer into resp. Close ends it
// with ErrClosed.
func (c *Client) call(ctx context.Context, name string, req, resp any) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(c.life, cancel)
	defer stop()
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return membership.ErrClosed
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+name, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hr.Header.Set("Content-Type", "application/json")
	if c.opts.Token != "" {
		hr.Header.Set("Authorization", "Bearer "+c.opts.Token)
	}
	r, err := c.hc.Do(hr)
	if err != nil {
		if c.life.Err() != nil {
			return membership.ErrClosed
		}
		return fmt.Errorf("memstore: %s: %w", name, err)
	}
	defer r.Body.Close()
	defer io.Copy(io.Discard, io.LimitReader(r.Body, 4<<10)) //nolint:errcheck // keeps the connection reusable
	if r.StatusCode != http.StatusOK {
		return fmt.Errorf("memstore: %s: %w", name, decodeError(r.StatusCode, r.Body))
	}
	if err := decodeJSON(r.Body, maxResponseBody, resp); err != nil {
		if c.life.Err() != nil {
			return membership.ErrClosed
		}
		return fmt.Errorf("memstore: %s answer: %w", name, err)
	}
	return nil
}

// Grant implements membership.Store.
func (c *Client) Grant(ctx context.Context, ttl time.Duration) (membership.LeaseID, time.Duration, error) {
	var r grantResp
	if err := c.call(ctx, "grant", grantReq{TTLMs: max(1, ttl.Milliseconds())}, &r); err != nil {
		return 0, 0, err
	}
	return r.Lease, time.Duration(r.TTLMs) * time.Millisecond, nil
}

// KeepAlive implements membership.Store.
func (c *Client) KeepAlive(ctx context.Context, id membership.LeaseID) (time.Duration, error) {
	var r ttlResp
	if err := c.call(ctx, "keepalive", leaseReq{Lease: id}, &r); err != nil {
		return 0, err
	}
	return time.Duration(r.TTLMs) * time.Millisecond, nil
}

// Revoke implements membership.Store.
func (c *Client) Revoke(ctx context.Context, id membership.LeaseID) error {
	return c.call(ctx, "revoke", leaseReq{Lease: id}, &struct{}{})
}

// Put implements membership.Store.
func (c *Client) Put(ctx context.Context, key string, value []byte, id membership.LeaseID) (int64, error) {
	var r revResp
	err := c.call(ctx, "put", putReq{Key: key, Value: value, Lease: id}, &r)
	return r.Rev, err
}

// List implements membership.Store.
func (c *Client) List(ctx context.Context, prefix string) ([]membership.KV, int64, error) {
	var r listResp
	if err := c.call(ctx, "list", listReq{Prefix: prefix}, &r); err != nil {
		return nil, 0, err
	}
	out := make([]membership.KV, len(r.KVs))
	for i, kv := range r.KVs {
		if !strings.HasPrefix(kv.Key, prefix) {
			return nil, 0, fmt.Errorf("memstore: list answer: %w: key %q outside %q", membership.ErrInvalid, clipName(kv.Key), clipName(prefix))
		}
		out[i] = membership.KV{Key: kv.Key, Value: kv.Value, CreateRev: kv.CreateRev, ModRev: kv.ModRev, Lease: kv.Lease}
	}
	return out, r.Rev, nil
}

// Watch implements membership.Store. The watch is a series of long polls,
// each carrying the revision to go on from; fromRev 0 starts at the
// store's revision now.
func (c *Client) Watch(ctx context.Context, prefix string, fromRev int64) (membership.Watcher, error) {
	if fromRev < 0 {
		return nil, fmt.Errorf("%w: revision %d", membership.ErrInvalid, fromRev)
	}
	if fromRev == 0 {
		_, rev, err := c.List(ctx, "\x00") // the revision only: no key starts with NUL
		if err != nil {
			return nil, err
		}
		fromRev = rev + 1
	}
	life, end := context.WithCancel(context.Background())
	return &clientWatcher{c: c, prefix: prefix, next: fromRev, life: life, end: end}, nil
}

// Close implements membership.Store: the calls under way (a watcher's
// long poll among them) end with ErrClosed, their connections closed,
// later calls fail with ErrClosed, and the idle connections of the
// client's own http.Client are closed.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	c.end()
	if c.own {
		c.hc.CloseIdleConnections()
	}
	return nil
}

type clientWatcher struct {
	c      *Client
	prefix string
	life   context.Context // canceled by Close
	end    context.CancelFunc

	mu     sync.Mutex
	next   int64
	closed bool
}

// Next implements membership.Watcher.
func (w *clientWatcher) Next(ctx context.Context) ([]membership.Event, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(w.life, cancel) // Close ends a Next under way
	defer stop()
	for {
		w.mu.Lock()
		closed, from := w.closed, w.next
		w.mu.Unlock()
		if closed {
			return nil, membership.ErrClosed
		}
		var r watchResp
		err := w.c.call(ctx, "watch", watchReq{Prefix: w.prefix, From: from, WaitMs: w.c.opts.PollWait.Milliseconds()}, &r)
		if err != nil {
			if w.life.Err() != nil {
				return nil, membership.ErrClosed
			}
			return nil, err
		}
		evs := make([]membership.Event, 0, len(r.Events))
		last := from - 1
		for _, e := range r.Events {
			ev, err := eventOf(e)
			if err != nil {
				return nil, fmt.Errorf("memstore: watch answer: %w", err)
			}
			if ev.Rev <= last || !strings.HasPrefix(ev.Key, w.prefix) {
				return nil, fmt.Errorf("memstore: watch answer: %w: event %d %q out of order or outside %q", membership.ErrInvalid, ev.Rev, clipName(ev.Key), clipName(w.prefix))
			}
			last = ev.Rev
			evs = append(evs, ev)
		}
		if r.Next <= last || r.Next < from {
			return nil, fmt.Errorf("memstore: watch answer: %w: next revision %d", membership.ErrInvalid, r.Next)
		}
		w.mu.Lock()
		w.next = r.Next
		w.mu.Unlock()
		if len(evs) > 0 {
			return evs, nil
		}
	}
}

// Close implements membership.Watcher; a Next under way returns
// ErrClosed.
func (w *clientWatcher) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.closed = true
		w.end()
	}
	return nil
}
