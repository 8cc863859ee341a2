package membership

import (
	"context"
	"errors"
	"time"
)

// Sentinel errors, matched with errors.Is. Stores wrap their own errors in
// them where a caller must branch.
var (
	// ErrLeaseNotFound: the lease expired or was revoked; its keys are gone.
	ErrLeaseNotFound = errors.New("membership: lease not found")
	// ErrCompacted: the store no longer holds the history a watch asked
	// for; list again and watch from the listed revision.
	ErrCompacted = errors.New("membership: revision compacted")
	// ErrLimit: a bound of the store (keys, leases, watchers, sizes) was
	// reached; the message says which.
	ErrLimit = errors.New("membership: store limit reached")
	// ErrInvalid: a key, value, record or argument the store refuses.
	ErrInvalid = errors.New("membership: invalid")
	// ErrClosed: the store, member or watcher was closed.
	ErrClosed = errors.New("membership: closed")
)

// LeaseID names a lease. Zero is no lease.
type LeaseID int64

// KV is one key as listed.
type KV struct {
	Key   string
	Value []byte
	// CreateRev and ModRev are the revisions that created and last
	// changed the key.
	CreateRev, ModRev int64
	Lease             LeaseID
}

// EventType is what happened to a key.
type EventType uint8

// Event types.
const (
	EventPut EventType = iota + 1
	EventDelete
)

func (t EventType) String() string {
	switch t {
	case EventPut:
		return "put"
	case EventDelete:
		return "delete"
	}
	return "event(?)"
}

// Event is one change of a key, at revision Rev. A delete carries no value.
type Event struct {
	Type  EventType
	Key   string
	Value []byte
	Rev   int64
}

// Store is the contract of a membership store: keys under leases, one
// revision counter for every change, list and watch from a revision.
//
// Every method may be called from any goroutine. A ctx bounds the call
// only, never a lease or a watch beyond it. After Close every method
// returns ErrClosed; Close is idempotent and does not revoke leases (a
// process that dies does not either: its leases expire).
type Store interface {
	// Grant creates a lease of ttl and returns its id and the TTL the
	// store granted (stores round up: etcd to whole seconds, 2 s at least
	// by default).
	Grant(ctx context.Context, ttl time.Duration) (LeaseID, time.Duration, error)
	// KeepAlive renews the lease once and returns its new TTL. A lease
	// the store no longer has is ErrLeaseNotFound.
	KeepAlive(ctx context.Context, id LeaseID) (time.Duration, error)
	// Revoke ends the lease and deletes its keys. An unknown lease is
	// ErrLeaseNotFound.
	Revoke(ctx context.Context, id LeaseID) error
	// Put sets key to value, attached to lease (0: none), and returns the
	// revision of the change.
	Put(ctx context.Context, key string, value []byte, lease LeaseID) (int64, error)
	// List returns the keys under prefix, sorted, and the store's
	// revision at which they were read: watching from rev+1 misses
	// nothing that happened after.
	List(ctx context.Context, prefix string) (kvs []KV, rev int64, err error)
	// Watch watches the keys under prefix from revision fromRev (0: from
	// now on). A fromRev the store has compacted away is ErrCompacted,
	// from Watch or from the watcher's first Next. The watcher belongs to
	// the caller, who closes it; ctx bounds only the call.
	Watch(ctx context.Context, prefix string, fromRev int64) (Watcher, error)
	// Close releases the store's connections.
	Close() error
}

// Watcher delivers the changes of a watch in revision order.
type Watcher interface {
	// Next blocks until one or more events, ctx's end, or the watch's
	// end: ErrCompacted when the store dropped history the watch still
	// needed (list again), another error when the watch broke. One
	// goroutine at a time.
	Next(ctx context.Context) ([]Event, error)
	// Close ends the watch; idempotent.
	Close() error
}
