package memstore

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/membership"
)

// HandlerOptions are the HTTP service's settings.
type HandlerOptions struct {
	// Token, when set, is the bearer token every call must carry
	// (Authorization: Bearer <token>); compared in constant time.
	// Without one, a call that carries a proxy's headers (Forwarded,
	// X-Forwarded-For, X-Forwarded-Host, X-Real-IP, Via) is refused.
	Token string
	// MaxWait bounds one watch poll (default and at most MaxWait).
	MaxWait time.Duration
	// AllowUnleased lets a put carry no lease (the conformance suite).
	AllowUnleased bool
}

// Handler serves s over HTTP at BasePath (kvxfer router mounts it with
// mux.Handle(BasePath+"/", h)). Each watch is a long poll of at most
// MaxWait that holds one of s's poll slots (Options.MaxPolls, apart from
// the watchers of the router's own view) while it waits; the client
// keeps the revision, so the server keeps no state per client.
func Handler(s *Store, opts HandlerOptions) http.Handler {
	if opts.MaxWait <= 0 || opts.MaxWait > MaxWait {
		opts.MaxWait = MaxWait
	}
	return &handler{s: s, opts: opts}
}

type handler struct {
	s    *Store
	opts HandlerOptions
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	name, ok := strings.CutPrefix(r.URL.Path, BasePath+"/")
	if !ok {
		http.NotFound(w, r)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeErr(w, http.StatusMethodNotAllowed, "method", "POST only")
		return
	}
	if h.opts.Token != "" {
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(h.opts.Token)) != 1 {
			writeErr(w, http.StatusUnauthorized, "unauthorized", "a valid bearer token is required")
			return
		}
	} else if h := proxied(r); h != "" {
		writeErr(w, http.StatusForbidden, "forbidden", "a store without a cluster secret answers direct calls only, not one a proxy forwarded ("+h+")")
		return
	}
	req, err := decodeRequest(name, http.MaxBytesReader(w, r.Body, maxRequestBody+1))
	if err != nil {
		fail(w, err)
		return
	}
	ctx := r.Context()
	var resp any
	switch q := req.(type) {
	case *grantReq:
		var id membership.LeaseID
		var ttl time.Duration
		id, ttl, err = h.s.Grant(ctx, time.Duration(q.TTLMs)*time.Millisecond)
		resp = grantResp{Lease: id, TTLMs: ttl.Milliseconds()}
	case *leaseReq:
		if name == "revoke" {
			err = h.s.Revoke(ctx, q.Lease)
			resp = struct{}{}
		} else {
			var ttl time.Duration
			ttl, err = h.s.KeepAlive(ctx, q.Lease)
			resp = ttlResp{TTLMs: ttl.Milliseconds()}
		}
	case *putReq:
		if q.Lease == 0 && !h.opts.AllowUnleased {
			// A worker's record lives by its lease: one without would
			// outlive whoever put it, counted and routed to by the router.
			fail(w, fmt.Errorf("%w: put of %s without a lease", membership.ErrInvalid, clipName(q.Key)))
			return
		}
		var rev int64
		rev, err = h.s.Put(ctx, q.Key, q.Value, q.Lease)
		resp = revResp{Rev: rev}
	case *listReq:
		var kvs []membership.KV
		var rev int64
		kvs, rev, err = h.s.List(ctx, q.Prefix)
		lr := listResp{KVs: make([]wireKV, len(kvs)), Rev: rev}
		for i, kv := range kvs {
			lr.KVs[i] = wireKV{Key: kv.Key, Value: kv.Value, CreateRev: kv.CreateRev, ModRev: kv.ModRev, Lease: kv.Lease}
		}
		resp = lr
	case *watchReq:
		resp, err = h.watch(ctx, q)
	}
	if err != nil {
		fail(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(resp)
}

// proxied returns the header that shows r was forwarded by a proxy, or "".
// Without a token the store trusts its loopback peers (kvxfer router
// allows no other way), and a proxy in front of the router makes anyone
// it serves such a peer. Not proof: a proxy may add none of these.
func proxied(r *http.Request) string {
	for _, h := range []string{"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-Ip", "Via"} {
		if r.Header.Get(h) != "" {
			return h
		}
	}
	return ""
}

// watch answers one long poll: the events from q.From on, waiting up to
// q.WaitMs (at most opts.MaxWait) for the first.
func (h *handler) watch(ctx context.Context, q *watchReq) (watchResp, error) {
	wt, err := h.s.watch(q.Prefix, q.From, true)
	if err != nil {
		return watchResp{}, err
	}
	defer wt.Close()
	wctx, cancel := context.WithTimeout(ctx, min(time.Duration(min(q.WaitMs, int64(MaxWait/time.Millisecond)))*time.Millisecond, h.opts.MaxWait))
	defer cancel()
	evs, err := wt.Next(wctx)
	next := wt.nextRev()
	if err != nil && !(errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil) {
		return watchResp{}, err
	}
	out := watchResp{Events: make([]wireEvent, len(evs)), Next: next}
	for i, ev := range evs {
		out.Events[i] = wireEvent{Type: ev.Type.String(), Key: ev.Key, Value: ev.Value, Rev: ev.Rev}
	}
	return out, nil
}

func fail(w http.ResponseWriter, err error) {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		writeErr(w, http.StatusRequestEntityTooLarge, "limit", err.Error())
		return
	}
	for _, c := range codes {
		if errors.Is(err, c.err) {
			writeErr(w, c.status, c.code, err.Error())
			return
		}
	}
	writeErr(w, http.StatusInternalServerError, "internal", err.Error())
}

func writeErr(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(errorBody{Code: code, Error: msg})
}
