package memstore

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/kvxfer/kvxfer/membership"
)

// Options bound a Store. Zero fields take the defaults.
type Options struct {
	MaxKeys     int // default 4096
	MaxLeases   int // default 4096
	MaxWatchers int // concurrent watchers of this process (Watch), default 256
	// MaxPolls bounds the HTTP long polls under way (Handler's watch
	// calls), apart from MaxWatchers, default 256.
	MaxPolls int
	// History is how many events the store keeps for watchers (default
	// 1024); a watcher that falls further behind gets ErrCompacted.
	History  int
	MaxValue int           // bytes per value, default membership.MaxRecordSize
	MinTTL   time.Duration // default 1 s; shorter ttls are raised to it
	MaxTTL   time.Duration // default 1 h; longer ones are refused
}

func (o Options) withDefaults() Options {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.MaxKeys, 4096)
	def(&o.MaxLeases, 4096)
	def(&o.MaxWatchers, 256)
	def(&o.MaxPolls, 256)
	def(&o.History, 1024)
	def(&o.MaxValue, membership.MaxRecordSize)
	if o.MinTTL <= 0 {
		o.MinTTL = time.Second
	}
	if o.MaxTTL <= 0 {
		o.MaxTTL = time.Hour
	}
	return o
}

// Store is the built-in store: keys, leases and a revision counter in
// memory, with a bounded history for watchers. It implements
// membership.Store; Handler serves it over HTTP and Client reaches it.
//
// New starts no goroutine: a lease's expiry is a runtime timer
// (time.AfterFunc) that Close stops. All methods are safe for concurrent
// use.
type Store struct {
	opts Options

	mu        sync.Mutex
	rev       int64
	compacted int64 // events up to this revision are gone
	kvs       map[string]*entry
	leases    map[membership.LeaseID]*lease
	history   []membership.Event // revision order, at most opts.History
	changed   chan struct{}      // closed and replaced at every change
	watchers  int
	polls     int // HTTP long polls under way
	closed    bool
}

type entry struct {
	value             []byte
	createRev, modRev int64
	lease             membership.LeaseID
}

type lease struct {
	ttl   time.Duration
	keys  map[string]bool
	timer *time.Timer
}

// New returns an empty Store bounded by opts.
func New(opts Options) *Store {
	return &Store{opts: opts.withDefaults(), kvs: map[string]*entry{}, leases: map[membership.LeaseID]*lease{},
		changed: make(chan struct{})}
}

var _ membership.Store = (*Store)(nil)

func checkKey(key string) error {
	if key == "" || len(key) > membership.MaxKeySize || !utf8.ValidString(key) {
		return fmt.Errorf("%w: key of %d bytes (1..%d, UTF-8)", membership.ErrInvalid, len(key), membership.MaxKeySize)
	}
	return nil
}

func checkPrefix(prefix string) error {
	if len(prefix) > membership.MaxKeySize || !utf8.ValidString(prefix) {
		return fmt.Errorf("%w: prefix of %d bytes (at most %d, UTF-8)", membership.ErrInvalid, len(prefix), membership.MaxKeySize)
	}
	return nil
}

// Grant implements membership.Store.
func (s *Store) Grant(ctx context.Context, ttl time.Duration) (membership.LeaseID, time.Duration, error) {
	if ttl > s.opts.MaxTTL {
		return 0, 0, fmt.Errorf("%w: ttl %v over %v", membership.ErrInvalid, ttl, s.opts.MaxTTL)
	}
	ttl = max(ttl, s.opts.MinTTL)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, 0, membership.ErrClosed
	}
	if len(s.leases) >= s.opts.MaxLeases {
		return 0, 0, fmt.Errorf("%w: %d leases", membership.ErrLimit, s.opts.MaxLeases)
	}
	// Random ids: a worker that still holds a lease of a store before a
	// restart must not renew another worker's lease by chance.
	id := membership.LeaseID(rand.Int64N(1<<62) + 1)
	for s.leases[id] != nil {
		id = membership.LeaseID(rand.Int64N(1<<62) + 1)
	}
	l := &lease{ttl: ttl, keys: map[string]bool{}}
	l.timer = time.AfterFunc(ttl, func() { s.expire(id, l) })
	s.leases[id] = l
	return id, ttl, nil
}

// expire ends lease l if it is still id's lease and its time is up (a
// keep-alive that raced the timer re-armed it).
func (s *Store) expire(id membership.LeaseID, l *lease) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.leases[id] != l {
		return
	}
	s.revokeLocked(id, l)
}

// KeepAlive implements membership.Store.
func (s *Store) KeepAlive(ctx context.Context, id membership.LeaseID) (time.Duration, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, membership.ErrClosed
	}
	l, ok := s.leases[id]
	if !ok || !l.timer.Stop() { // the timer fired: expiry is under way
		return 0, fmt.Errorf("%w: %d", membership.ErrLeaseNotFound, id)
	}
	l.timer.Reset(l.ttl)
	return l.ttl, nil
}

// Revoke implements membership.Store.
func (s *Store) Revoke(ctx context.Context, id membership.LeaseID) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return membership.ErrClosed
	}
	l, ok := s.leases[id]
	if !ok {
		return fmt.Errorf("%w: %d", membership.ErrLeaseNotFound, id)
	}
	l.timer.Stop()
	s.revokeLocked(id, l)
	return nil
}

func (s *Store) revokeLocked(id membership.LeaseID, l *lease) {
	delete(s.leases, id)
	keys := make([]string, 0, len(l.keys))
	for k := range l.keys {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		delete(s.kvs, k)
		s.record(membership.Event{Type: membership.EventDelete, Key: k})
	}
}

// record appends ev at the next revision and wakes the watchers. s.mu is
// held.
func (s *Store) record(ev membership.Event) int64 {
	s.rev++
	ev.Rev = s.rev
	s.history = append(s.history, ev)
	if over := len(s.history) - s.opts.History; over > 0 {
		s.compacted = s.history[over-1].Rev
		s.history = slices.Delete(s.history, 0, over)
	}
	close(s.changed)
	s.changed = make(chan struct{})
	return s.rev
}

// Put implements membership.Store.
func (s *Store) Put(ctx context.Context, key string, value []byte, id membership.LeaseID) (int64, error) {
	if err := checkKey(key); err != nil {
		return 0, err
	}
	if len(value) > s.opts.MaxValue {
		return 0, fmt.Errorf("%w: value of %d bytes, at most %d", membership.ErrLimit, len(value), s.opts.MaxValue)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, membership.ErrClosed
	}
	var l *lease
	if id != 0 {
		var ok bool
		if l, ok = s.leases[id]; !ok {
			return 0, fmt.Errorf("%w: %d", membership.ErrLeaseNotFound, id)
		}
	}
	e, exists := s.kvs[key]
	if !exists && len(s.kvs) >= s.opts.MaxKeys {
		return 0, fmt.Errorf("%w: %d keys", membership.ErrLimit, s.opts.MaxKeys)
	}
	v := slices.Clone(value)
	rev := s.record(membership.Event{Type: membership.EventPut, Key: key, Value: v})
	if !exists {
		e = &entry{createRev: rev}
		s.kvs[key] = e
	} else if old, ok := s.leases[e.lease]; ok && e.lease != id {
		delete(old.keys, key)
	}
	e.value, e.modRev, e.lease = v, rev, id
	if l != nil {
		l.keys[key] = true
	}
	return rev, nil
}

// List implements membership.Store.
func (s *Store) List(ctx context.Context, prefix string) ([]membership.KV, int64, error) {
	if err := checkPrefix(prefix); err != nil {
		return nil, 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, 0, membership.ErrClosed
	}
	var out []membership.KV
	for k, e := range s.kvs {
		if strings.HasPrefix(k, prefix) {
			out = append(out, membership.KV{Key: k, Value: slices.Clone(e.value), CreateRev: e.createRev, ModRev: e.modRev, Lease: e.lease})
		}
	}
	slices.SortFunc(out, func(a, b membership.KV) int { return strings.Compare(a.Key, b.Key) })
	return out, s.rev, nil
}

// Compact drops the history up to rev (as etcd's compaction does): a
// watch from rev or before gets ErrCompacted.
func (s *Store) Compact(rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rev = min(rev, s.rev)
	if rev <= s.compacted {
		return
	}
	i, _ := slices.BinarySearchFunc(s.history, rev+1, func(e membership.Event, r int64) int { return int(e.Rev - r) })
	s.history = slices.Delete(s.history, 0, i)
	s.compacted = rev
}

// Rev returns the store's current revision.
func (s *Store) Rev() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rev
}

// Close implements membership.Store: it stops every lease's timer and
// ends every watch; the data is dropped.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	for _, l := range s.leases {
		l.timer.Stop()
	}
	s.leases, s.kvs, s.history = nil, nil, nil
	close(s.changed)
	return nil
}

// Watch implements membership.Store.
func (s *Store) Watch(ctx context.Context, prefix string, fromRev int64) (membership.Watcher, error) {
	w, err := s.watch(prefix, fromRev, false)
	if err != nil {
		return nil, err
	}
	return w, nil
}

// watch opens a watcher: one of this process's (Watch), or for poll one
// HTTP long poll, counted apart so that the polls never take the slots of
// the router's own view.
func (s *Store) watch(prefix string, fromRev int64, poll bool) (*watcher, error) {
	if err := checkPrefix(prefix); err != nil {
		return nil, err
	}
	if fromRev < 0 {
		return nil, fmt.Errorf("%w: revision %d", membership.ErrInvalid, fromRev)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, membership.ErrClosed
	}
	switch {
	case poll && s.polls >= s.opts.MaxPolls:
		return nil, fmt.Errorf("%w: %d HTTP long polls", membership.ErrLimit, s.opts.MaxPolls)
	case !poll && s.watchers >= s.opts.MaxWatchers:
		return nil, fmt.Errorf("%w: %d watchers", membership.ErrLimit, s.opts.MaxWatchers)
	}
	if fromRev == 0 {
		fromRev = s.rev + 1
	}
	if poll {
		s.polls++
	} else {
		s.watchers++
	}
	return &watcher{s: s, prefix: prefix, next: fromRev, poll: poll, done: make(chan struct{})}, nil
}

// poll returns the events under prefix from revision from on, the revision
// to poll from next, and a channel closed at the next change. A from at or
// below the compacted revision is ErrCompacted (unless nothing under any
// prefix was dropped after from: a watch that is exactly caught up).
func (s *Store) poll(prefix string, from int64) ([]membership.Event, int64, <-chan struct{}, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, from, nil, membership.ErrClosed
	}
	if from <= s.compacted {
		return nil, from, nil, fmt.Errorf("%w: revision %d, history starts after %d", membership.ErrCompacted, from, s.compacted)
	}
	var out []membership.Event
	i, _ := slices.BinarySearchFunc(s.history, from, func(e membership.Event, r int64) int { return int(e.Rev - r) })
	for _, ev := range s.history[i:] {
		if strings.HasPrefix(ev.Key, prefix) {
			ev.Value = slices.Clone(ev.Value)
			out = append(out, ev)
		}
	}
	return out, max(from, s.rev+1), s.changed, nil
}

type watcher struct {
	s      *Store
	prefix string
	poll   bool // an HTTP long poll's (counted in s.polls)

	done chan struct{} // closed by Close, ends a waiting Next

	mu     sync.Mutex
	next   int64
	closed bool
}

// Next implements membership.Watcher.
func (w *watcher) Next(ctx context.Context) ([]membership.Event, error) {
	for {
		w.mu.Lock()
		if w.closed {
			w.mu.Unlock()
			return nil, membership.ErrClosed
		}
		evs, next, changed, err := w.s.poll(w.prefix, w.next)
		if err == nil {
			w.next = next
		}
		w.mu.Unlock()
		if err != nil || len(evs) > 0 {
			return evs, err
		}
		select {
		case <-changed:
		case <-w.done:
			return nil, membership.ErrClosed
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Close implements membership.Watcher.
func (w *watcher) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	w.closed = true
	close(w.done)
	w.s.mu.Lock()
	if w.poll {
		w.s.polls--
	} else {
		w.s.watchers--
	}
	w.s.mu.Unlock()
	return nil
}

// nextRev is the revision the watcher polls from next.
func (w *watcher) nextRev() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.next
}

// polling returns the number of HTTP long polls under way.
func (s *Store) polling() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.polls
}
