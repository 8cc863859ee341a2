package membership

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// WorkerInfo is one registered worker as the router sees it.
type WorkerInfo struct {
	Key    string
	ID     string
	Record Record
	// ModRev is the revision of the record's last change.
	ModRev int64
}

// ChangeKind says how the set of active workers changed.
type ChangeKind uint8

// Change kinds.
const (
	// Joined: a worker to route to. A restart on the same URL is Left of
	// the old incarnation followed by Joined of the new one.
	Joined ChangeKind = iota + 1
	// Left: a worker to stop routing to (its key is gone, or a newer
	// incarnation took its URL).
	Left
	// Updated: the same member put a new record (a re-registration).
	Updated
)

func (k ChangeKind) String() string {
	switch k {
	case Joined:
		return "joined"
	case Left:
		return "left"
	case Updated:
		return "updated"
	}
	return "change(?)"
}

// Change is one change of the active set.
type Change struct {
	Kind   ChangeKind
	Worker WorkerInfo
}

// ViewOptions are a View's settings.
type ViewOptions struct {
	// Cluster is disagg_cluster.cluster_name.
	Cluster string
	// OnChange, when set, is called from Run's goroutine with the changes
	// of each batch of events or resync, never concurrently and never
	// with View's lock held (it may call Workers).
	OnChange func([]Change)
	// Accept, when set, says whether the router may route to a record
	// that decoded and agrees with its key: one it refuses (an error
	// saying why) is skipped like a record that does not decode, logged
	// and counted in BadRecords.
	Accept func(*Record) error
	// ListTimeout bounds each list of the workers (default 10 s): a store
	// out of reach (an etcd client waits for a connection without a
	// deadline of its own) is then given up, logged and listed again with
	// backoff.
	ListTimeout time.Duration
	// RetryMin and RetryMax bound the backoff between failed resyncs
	// (default 100 ms and 2 s).
	RetryMin, RetryMax time.Duration
	Logger             *slog.Logger
}

// ViewStats count what a View did.
type ViewStats struct {
	Rev        int64  // the revision the view reflects
	Synced     bool   // a list has succeeded and the watch is live
	Resyncs    uint64 // full lists after the first
	Events     uint64
	BadRecords uint64 // keys or values that did not decode; skipped
}

// View is the router's picture of the cluster's workers: every record in
// the store (all), and per role and URL the active one, the newest
// incarnation present. Run keeps it current; Workers and Stats may be
// called from any goroutine.
type View struct {
	store Store
	opts  ViewOptions
	log   *slog.Logger

	mu     sync.Mutex
	all    map[string]WorkerInfo // by key
	active map[urlKey]WorkerInfo
	stats  ViewStats

	// Lines about skipped records: at most one a second (badEvery), the
	// next one counting those left out. Never held with mu.
	logMu      sync.Mutex
	badLogged  time.Time
	badSkipped uint64
}

// badEvery is the least time between two lines about skipped records:
// whoever can write to the store could otherwise have the router log one
// line per record, and every bad record again at each resync.
const badEvery = time.Second

type urlKey struct {
	role Role
	url  string
}

// NewView returns an empty View of opts.Cluster's workers in store. It
// does not own store.
func NewView(store Store, opts ViewOptions) *View {
	if opts.ListTimeout <= 0 {
		opts.ListTimeout = 10 * time.Second
	}
	if opts.RetryMin <= 0 {
		opts.RetryMin = 100 * time.Millisecond
	}
	if opts.RetryMax < opts.RetryMin {
		opts.RetryMax = max(opts.RetryMin, 2*time.Second)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &View{store: store, opts: opts, log: opts.Logger, all: map[string]WorkerInfo{}, active: map[urlKey]WorkerInfo{}}
}

// Workers returns the active workers of role ("" for both), sorted by role
// and URL.
func (v *View) Workers(role Role) []WorkerInfo {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]WorkerInfo, 0, len(v.active))
	for k, w := range v.active {
		if role == "" || k.role == role {
			out = append(out, w)
		}
	}
	slices.SortFunc(out, func(a, b WorkerInfo) int {
		return cmp.Or(cmp.Compare(a.Record.Role, b.Record.Role), cmp.Compare(a.Record.URL, b.Record.URL))
	})
	return out
}

// Stats returns the view's counters.
func (v *View) Stats() ViewStats {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.stats
}

// Run lists the workers, then watches from the listed revision, until ctx
// ends (it returns ctx's error) or the store is closed (an error wrapping
// ErrClosed). After ErrCompacted or a broken watch it lists again,
// reporting the difference as changes; a store that cannot be reached is
// retried with backoff, the view keeping its last picture.
func (v *View) Run(ctx context.Context) error {
	prefix := Prefix(v.opts.Cluster)
	backoff := v.opts.RetryMin
	first := true
	for {
		err := v.resync(ctx, prefix, first)
		if err == nil {
			first = false
			backoff = v.opts.RetryMin
			err = v.watch(ctx, prefix)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		v.mu.Lock()
		v.stats.Synced = false
		v.mu.Unlock()
		if errors.Is(err, ErrCompacted) {
			v.log.Info("membership: watch compacted, listing again", "err", err)
			continue
		}
		if errors.Is(err, ErrClosed) {
			// Its owner closed the store (a router that stops): nothing
			// more will come, and listing again cannot help.
			v.log.Info("membership: the store was closed; the view keeps its last picture", "err", err)
			return err
		}
		v.log.Warn("membership: watch broken, listing again", "err", err, "backoff", backoff)
		if !sleepUntil(ctx, time.Now().Add(backoff)) {
			return ctx.Err()
		}
		backoff = min(2*backoff, v.opts.RetryMax)
	}
}

// resync replaces the picture with a full list.
func (v *View) resync(ctx context.Context, prefix string, first bool) error {
	lctx, cancel := context.WithTimeout(ctx, v.opts.ListTimeout)
	kvs, rev, err := v.store.List(lctx, prefix)
	cancel()
	if err != nil {
		return fmt.Errorf("membership: list %s: %w", prefix, err)
	}
	all := make(map[string]WorkerInfo, len(kvs))
	bad := uint64(0)
	for _, kv := range kvs {
		if w, ok := v.decode(kv.Key, kv.Value, kv.ModRev); ok {
			all[kv.Key] = w
		} else {
			bad++
		}
	}
	v.mu.Lock()
	v.all = all
	v.stats.Rev, v.stats.Synced = rev, true
	v.stats.BadRecords += bad
	if !first {
		v.stats.Resyncs++
	}
	changes := v.recompute()
	v.mu.Unlock()
	v.notify(changes)
	return nil
}

// watch applies the watch's events until it ends.
func (v *View) watch(ctx context.Context, prefix string) error {
	v.mu.Lock()
	from := v.stats.Rev + 1
	v.mu.Unlock()
	w, err := v.store.Watch(ctx, prefix, from)
	if err != nil {
		return fmt.Errorf("membership: watch %s from %d: %w", prefix, from, err)
	}
	defer w.Close()
	for {
		evs, err := w.Next(ctx)
		if err != nil {
			return err
		}
		v.mu.Lock()
		bad := uint64(0)
		for _, ev := range evs {
			if ev.Rev <= v.stats.Rev {
				continue // already in the picture (a stale event)
			}
			v.stats.Rev = ev.Rev
			v.stats.Events++
			switch ev.Type {
			case EventPut:
				if w, ok := v.decode(ev.Key, ev.Value, ev.Rev); ok {
					v.all[ev.Key] = w
				} else {
					delete(v.all, ev.Key)
					bad++
				}
			case EventDelete:
				delete(v.all, ev.Key)
			}
		}
		v.stats.BadRecords += bad
		changes := v.recompute()
		v.mu.Unlock()
		v.notify(changes)
	}
}

// decode turns a key and value into a WorkerInfo; a key or record that
// does not decode, or whose record disagrees with its key, is skipped.
func (v *View) decode(key string, value []byte, rev int64) (WorkerInfo, bool) {
	role, id, inc, err := ParseKey(v.opts.Cluster, key)
	var rec *Record
	if err == nil {
		rec, err = DecodeRecord(value)
	}
	if err == nil {
		if rid, _ := rec.ID(); rec.Role != role || rec.Incarnation != inc || rid != id {
			err = fmt.Errorf("%w: record of %s %s under key %s", ErrInvalid, rec.Role, rid, clip(key))
		} else if v.opts.Accept != nil {
			if aerr := v.opts.Accept(rec); aerr != nil {
				err = fmt.Errorf("%w: record of %s %s refused: %v", ErrInvalid, rec.Role, clip(rec.URL), aerr)
			}
		}
	}
	if err != nil {
		v.logBad(key, err)
		return WorkerInfo{}, false
	}
	return WorkerInfo{Key: key, ID: id, Record: *rec, ModRev: rev}, true
}

// logBad logs a skipped record unless a line was logged less than
// badEvery ago; the next line says how many were skipped meanwhile
// (ViewStats.BadRecords counts them all).
func (v *View) logBad(key string, err error) {
	v.logMu.Lock()
	now := time.Now()
	if !v.badLogged.IsZero() && now.Sub(v.badLogged) < badEvery {
		v.badSkipped++
		v.logMu.Unlock()
		return
	}
	more := v.badSkipped
	v.badLogged, v.badSkipped = now, 0
	v.logMu.Unlock()
	v.log.Warn("membership: skipping a worker record", "key", clip(key), "err", err, "skipped_unlogged_before", more)
}

// recompute derives the active set from all (the newest incarnation per
// role and URL) and returns how it changed. v.mu is held.
func (v *View) recompute() []Change {
	active := make(map[urlKey]WorkerInfo, len(v.active))
	for _, w := range v.all {
		k := urlKey{w.Record.Role, w.Record.URL}
		if cur, ok := active[k]; !ok || newer(w, cur) {
			active[k] = w
		}
	}
	var changes []Change
	for k, old := range v.active {
		nw, ok := active[k]
		switch {
		case !ok || nw.Key != old.Key:
			changes = append(changes, Change{Left, old})
		case nw.ModRev != old.ModRev:
			changes = append(changes, Change{Updated, nw})
		}
	}
	for k, nw := range active {
		if old, ok := v.active[k]; !ok || old.Key != nw.Key {
			changes = append(changes, Change{Joined, nw})
		}
	}
	v.active = active
	// Left before Joined (a restart reads in order), then by URL.
	slices.SortStableFunc(changes, func(a, b Change) int {
		return cmp.Or(cmp.Compare(rank[a.Kind], rank[b.Kind]), cmp.Compare(a.Worker.Record.URL, b.Worker.Record.URL))
	})
	return changes
}

// rank orders a batch's changes: Left, Updated, Joined.
var rank = map[ChangeKind]int{Left: 0, Updated: 1, Joined: 2}

func newer(a, b WorkerInfo) bool {
	if a.Record.Incarnation != b.Record.Incarnation {
		return a.Record.Incarnation > b.Record.Incarnation
	}
	return a.Key > b.Key
}

func (v *View) notify(changes []Change) {
	if len(changes) > 0 && v.opts.OnChange != nil {
		v.opts.OnChange(changes)
	}
}

// ListWorkers lists cluster's workers once, without watching (for a
// status command): every record present, older incarnations included,
// sorted by key, and how many keys did not decode.
func ListWorkers(ctx context.Context, store Store, cluster string) ([]WorkerInfo, int, error) {
	kvs, _, err := store.List(ctx, Prefix(cluster))
	if err != nil {
		return nil, 0, fmt.Errorf("membership: list %s: %w", Prefix(cluster), err)
	}
	v := &View{opts: ViewOptions{Cluster: cluster}, log: slog.New(slog.DiscardHandler)}
	out := make([]WorkerInfo, 0, len(kvs))
	bad := 0
	for _, kv := range kvs {
		if w, ok := v.decode(kv.Key, kv.Value, kv.ModRev); ok {
			out = append(out, w)
		} else {
			bad++
		}
	}
	return out, bad, nil
}
