package memstore

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/kvxfer/kvxfer/membership"
)

// The HTTP protocol of the built-in store. Every call is a POST of one JSON
// object to BasePath + "/" + name; the answer is one JSON object, with
// status 200, or an errorBody with the status errors map to.

// BasePath is where Handler serves; kvxfer router mounts it there.
const BasePath = "/kvxfer/membership/v1"

// Bounds of the wire.
const (
	maxRequestBody = 64 << 10
	// MaxWait bounds one long poll of a watch; the client polls again.
	MaxWait = 30 * time.Second
)

type grantReq struct {
	TTLMs int64 `json:"ttl_ms"`
}
type grantResp struct {
	Lease membership.LeaseID `json:"lease"`
	TTLMs int64              `json:"ttl_ms"`
}
type leaseReq struct {
	Lease membership.LeaseID `json:"lease"`
}
type ttlResp struct {
	TTLMs int64 `json:"ttl_ms"`
}
type putReq struct {
	Key   string             `json:"key"`
	Value []byte             `json:"value"`
	Lease membership.LeaseID `json:"lease"`
}
type revResp struct {
	Rev int64 `json:"rev"`
}
type listReq struct {
	Prefix string `json:"prefix"`
}
type wireKV struct {
	Key       string             `json:"key"`
	Value     []byte             `json:"value"`
	CreateRev int64              `json:"create_rev"`
	ModRev    int64              `json:"mod_rev"`
	Lease     membership.LeaseID `json:"lease"`
}
type listResp struct {
	KVs []wireKV `json:"kvs"`
	Rev int64    `json:"rev"`
}
type watchReq struct {
	Prefix string `json:"prefix"`
	From   int64  `json:"from"`
	WaitMs int64  `json:"wait_ms"`
}
type wireEvent struct {
	Type  string `json:"type"` // "put" or "delete"
	Key   string `json:"key"`
	Value []byte `json:"value,omitempty"`
	Rev   int64  `json:"rev"`
}
type watchResp struct {
	Events []wireEvent `json:"events"`
	// Next is the revision to poll from next.
	Next int64 `json:"next"`
}
type errorBody struct {
	Code  string `json:"code"`
	Error string `json:"error"`
}

// Error codes and the sentinels they stand for.
var codes = []struct {
	code   string
	status int
	err    error
}{
	{"lease_not_found", http.StatusNotFound, membership.ErrLeaseNotFound},
	{"compacted", http.StatusGone, membership.ErrCompacted},
	{"limit", http.StatusTooManyRequests, membership.ErrLimit},
	{"invalid", http.StatusBadRequest, membership.ErrInvalid},
	{"closed", http.StatusServiceUnavailable, membership.ErrClosed},
}

// decodeJSON reads exactly one JSON object of at most limit bytes into v,
// refusing unknown fields and trailing data.
func decodeJSON(r io.Reader, limit int64, v any) error {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return fmt.Errorf("%w: reading body: %v", membership.ErrInvalid, err)
	}
	if int64(len(b)) > limit {
		return fmt.Errorf("%w: body over %d bytes", membership.ErrLimit, limit)
	}
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return fmt.Errorf("%w: body: %v", membership.ErrInvalid, err)
	}
	if _, err := d.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: body: trailing data", membership.ErrInvalid)
	}
	return nil
}

// decodeRequest decodes and checks the request of call name; it returns
// the typed request.
func decodeRequest(name string, r io.Reader) (any, error) {
	var v any
	switch name {
	case "grant":
		v = new(grantReq)
	case "keepalive", "revoke":
		v = new(leaseReq)
	case "put":
		v = new(putReq)
	case "list":
		v = new(listReq)
	case "watch":
		v = new(watchReq)
	default:
		return nil, fmt.Errorf("%w: no call %q", membership.ErrInvalid, clipName(name))
	}
	if err := decodeJSON(r, maxRequestBody, v); err != nil {
		return nil, err
	}
	switch q := v.(type) {
	case *grantReq:
		if q.TTLMs <= 0 || q.TTLMs > int64(24*time.Hour/time.Millisecond) {
			return nil, fmt.Errorf("%w: ttl_ms %d", membership.ErrInvalid, q.TTLMs)
		}
	case *leaseReq:
		if q.Lease <= 0 {
			return nil, fmt.Errorf("%w: lease %d", membership.ErrInvalid, q.Lease)
		}
	case *putReq:
		if err := checkKey(q.Key); err != nil {
			return nil, err
		}
		if q.Lease < 0 {
			return nil, fmt.Errorf("%w: lease %d", membership.ErrInvalid, q.Lease)
		}
	case *listReq:
		if err := checkPrefix(q.Prefix); err != nil {
			return nil, err
		}
	case *watchReq:
		if err := checkPrefix(q.Prefix); err != nil {
			return nil, err
		}
		if q.From < 0 || q.WaitMs < 0 {
			return nil, fmt.Errorf("%w: from %d, wait_ms %d", membership.ErrInvalid, q.From, q.WaitMs)
		}
	}
	return v, nil
}

func clipName(s string) string {
	if len(s) > 32 {
		return s[:32] + "…"
	}
	return s
}

// decodeError turns an error answer back into its sentinel.
func decodeError(status int, body io.Reader) error {
	var e errorBody
	if err := decodeJSON(body, 4<<10, &e); err != nil {
		return fmt.Errorf("memstore: status %d without an error body", status)
	}
	for _, c := range codes {
		if c.code == e.Code {
			return fmt.Errorf("%w (store: %s)", c.err, clipName(e.Error))
		}
	}
	return fmt.Errorf("memstore: status %d: %s", status, clipName(e.Error))
}

func eventOf(e wireEvent) (membership.Event, error) {
	ev := membership.Event{Key: e.Key, Value: e.Value, Rev: e.Rev}
	switch e.Type {
	case "put":
		ev.Type = membership.EventPut
	case "delete":
		ev.Type = membership.EventDelete
	default:
		return ev, fmt.Errorf("%w: event type %q", membership.ErrInvalid, clipName(e.Type))
	}
	if e.Rev <= 0 {
		return ev, fmt.Errorf("%w: event revision %d", membership.ErrInvalid, e.Rev)
	}
	return ev, nil
}
