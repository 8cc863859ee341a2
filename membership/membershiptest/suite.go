package membershiptest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvxfer/kvxfer/membership"
)

// Harness is what the suite needs of a store.
type Harness struct {
	// Addr is the store's host:port, which Dial reaches; the stall tests
	// dial a StallProxy in front of it instead.
	Addr string
	// Dial returns a new client of the store at addr; the suite closes it.
	Dial func(t testing.TB, addr string) membership.Store
	// Compact makes the store forget its history up to rev.
	Compact func(t testing.TB, rev int64)
	// MinTTL is the shortest lease the store grants (etcd: 2 s).
	MinTTL time.Duration
}

var clusterSeq atomic.Int64

// cluster returns a cluster name of its own for one test.
func cluster(t testing.TB) string {
	return fmt.Sprintf("c%d-%s", clusterSeq.Add(1), strings.NewReplacer("/", "-", " ", "_").Replace(t.Name()))
}

// Run runs the conformance suite against h's store.
func Run(t *testing.T, h Harness) {
	for _, tc := range []struct {
		name string
		f    func(*testing.T, Harness)
	}{
		{"PutList", testPutList},
		{"LeaseExpiry", testLeaseExpiry},
		{"Revoke", testRevoke},
		{"WatchCompacted", testWatchCompacted},
		{"ListWatchConcurrentJoins", testListWatchConcurrentJoins},
		{"ViewConcurrentJoins", testViewConcurrentJoins},
		{"ViewResyncAfterCompaction", testViewResync},
		{"ViewStaleDelete", testViewStaleDelete},
		{"KeepAliveStalledStore", testKeepAliveStalled},
		{"MemberLifecycle", testMemberLifecycle},
		{"JoinLeaveLatency", testJoinLeaveLatency},
		{"Close", testClose},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			tc.f(t, h)
		})
	}
}

// noLeaks checks, after every other cleanup, that the test left no
// goroutine behind.
func noLeaks(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		var err error
		for range 10 { // ~5 s: connections wind down after Close
			if err = goleak.Find(opt); err == nil {
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Error(err)
	})
}

func dial(t *testing.T, h Harness, addr string) membership.Store {
	s := h.Dial(t, addr)
	t.Cleanup(func() { s.Close() })
	return s
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

func testPutList(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	ctx := ctxFor(t, 10*time.Second)
	p := membership.Prefix(cluster(t))
	lease, ttl, err := s.Grant(ctx, max(h.MinTTL, 5*time.Second))
	if err != nil || ttl < h.MinTTL {
		t.Fatalf("Grant = %v, %v, %v", lease, ttl, err)
	}
	var revs []int64
	for _, k := range []string{"b", "a", "c"} {
		rev, err := s.Put(ctx, p+k, []byte("v-"+k), lease)
		if err != nil {
			t.Fatalf("Put %s: %v", k, err)
		}
		revs = append(revs, rev)
	}
	if !slices.IsSorted(revs) || revs[0] == revs[1] {
		t.Errorf("put revisions %v: want increasing", revs)
	}
	rev2, err := s.Put(ctx, p+"a", []byte("v-a2"), lease)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, p[:len(p)-1]+"x", []byte("outside"), 0); err != nil {
		t.Fatal(err)
	}
	kvs, rev, err := s.List(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	if rev < rev2 {
		t.Errorf("List revision %d before the last put's %d", rev, rev2)
	}
	var keys []string
	for _, kv := range kvs {
		keys = append(keys, strings.TrimPrefix(kv.Key, p))
		if kv.Lease != lease {
			t.Errorf("%s: lease %d, want %d", kv.Key, kv.Lease, lease)
		}
	}
	if !slices.Equal(keys, []string{"a", "b", "c"}) {
		t.Fatalf("List keys %v, want [a b c] in order", keys)
	}
	if a := kvs[0]; string(a.Value) != "v-a2" || a.ModRev != rev2 || a.CreateRev != revs[1] {
		t.Errorf("a = %q mod %d create %d, want v-a2 mod %d create %d", a.Value, a.ModRev, a.CreateRev, rev2, revs[1])
	}
	if _, err := s.Put(ctx, p+"d", []byte("x"), lease+12345); !errors.Is(err, membership.ErrLeaseNotFound) {
		t.Errorf("Put under an unknown lease: %v, want ErrLeaseNotFound", err)
	}
}

// waitEvents reads w until cond holds for the events read so far.
func waitEvents(t *testing.T, w membership.Watcher, d time.Duration, cond func([]membership.Event) bool) []membership.Event {
	t.Helper()
	ctx := ctxFor(t, d)
	var all []membership.Event
	for !cond(all) {
		evs, err := w.Next(ctx)
		if err != nil {
			t.Fatalf("watch: %v (events so far: %v)", err, all)
		}
		all = append(all, evs...)
	}
	return all
}

func deletes(evs []membership.Event) map[string]bool {
	m := map[string]bool{}
	for _, e := range evs {
		if e.Type == membership.EventDelete {
			m[e.Key] = true
		}
	}
	return m
}

func testLeaseExpiry(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	ctx := ctxFor(t, 20*time.Second)
	p := membership.Prefix(cluster(t))
	// From before the grant: the lease's time runs from it, and the Put
	// and Watch after it may take a good part of a short ttl on a loaded
	// machine, which counted from after them looked like an early expiry.
	start := time.Now()
	lease, ttl, err := s.Grant(ctx, h.MinTTL)
	if err != nil {
		t.Fatal(err)
	}
	rev, err := s.Put(ctx, p+"k", []byte("v"), lease)
	if err != nil {
		t.Fatal(err)
	}
	w, err := s.Watch(ctx, p, rev+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	waitEvents(t, w, ttl+5*time.Second, func(evs []membership.Event) bool { return deletes(evs)[p+"k"] })
	if el := time.Since(start); el < ttl/2 {
		t.Errorf("key deleted after %v, lease ttl %v", el, ttl)
	}
	if _, err := s.KeepAlive(ctx, lease); !errors.Is(err, membership.ErrLeaseNotFound) {
		t.Errorf("KeepAlive of an expired lease: %v, want ErrLeaseNotFound", err)
	}
	if kvs, _, err := s.List(ctx, p); err != nil || len(kvs) != 0 {
		t.Errorf("List after expiry = %v, %v; want nothing", kvs, err)
	}
}

func testRevoke(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	ctx := ctxFor(t, 10*time.Second)
	p := membership.Prefix(cluster(t))
	lease, _, err := s.Grant(ctx, max(h.MinTTL, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var rev int64
	for _, k := range []string{"a", "b"} {
		if rev, err = s.Put(ctx, p+k, []byte("v"), lease); err != nil {
			t.Fatal(err)
		}
	}
	w, err := s.Watch(ctx, p, rev+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := s.KeepAlive(ctx, lease); err != nil {
		t.Fatalf("KeepAlive: %v", err)
	}
	if err := s.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	waitEvents(t, w, 5*time.Second, func(evs []membership.Event) bool { d := deletes(evs); return d[p+"a"] && d[p+"b"] })
	if kvs, _, err := s.List(ctx, p); err != nil || len(kvs) != 0 {
		t.Errorf("List after revoke = %v, %v; want nothing", kvs, err)
	}
	if err := s.Revoke(ctx, lease); !errors.Is(err, membership.ErrLeaseNotFound) {
		t.Errorf("second Revoke: %v, want ErrLeaseNotFound", err)
	}
}

func testWatchCompacted(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	ctx := ctxFor(t, 10*time.Second)
	p := membership.Prefix(cluster(t))
	r1, err := s.Put(ctx, p+"a", []byte("1"), 0)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := s.Put(ctx, p+"a", []byte("2"), 0)
	if err != nil {
		t.Fatal(err)
	}
	h.Compact(t, r2)
	w, err := s.Watch(ctx, p, r1)
	if err == nil {
		_, err = w.Next(ctx)
		w.Close()
	}
	if !errors.Is(err, membership.ErrCompacted) {
		t.Fatalf("watch from compacted revision %d (compacted to %d): %v, want ErrCompacted", r1, r2, err)
	}
	// From after the compaction: works.
	w, err = s.Watch(ctx, p, r2+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := s.Put(ctx, p+"b", []byte("3"), 0); err != nil {
		t.Fatal(err)
	}
	evs := waitEvents(t, w, 5*time.Second, func(evs []membership.Event) bool { return len(evs) > 0 })
	if evs[0].Key != p+"b" || evs[0].Type != membership.EventPut || string(evs[0].Value) != "3" {
		t.Errorf("event %+v, want put of %sb", evs[0], p)
	}
}

// testListWatchConcurrentJoins lists and then watches from the listed
// revision while keys are put concurrently: every key is seen, in the
// list or in the watch.
func testListWatchConcurrentJoins(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	joiner := dial(t, h, h.Addr)
	ctx := ctxFor(t, 20*time.Second)
	p := membership.Prefix(cluster(t))
	const n = 24
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			time.Sleep(time.Duration(i%8) * time.Millisecond)
			if _, err := joiner.Put(ctx, fmt.Sprintf("%sk%02d", p, i), []byte("v"), 0); err != nil {
				errs <- err
			}
		})
	}
	time.Sleep(3 * time.Millisecond)
	kvs, rev, err := s.List(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, kv := range kvs {
		seen[kv.Key] = true
	}
	listed := len(seen)
	w, err := s.Watch(ctx, p, rev+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for len(seen) < n {
		evs, err := w.Next(ctx)
		if err != nil {
			t.Fatalf("watch: %v; seen %d of %d keys (%d listed)", err, len(seen), n, listed)
		}
		for _, e := range evs {
			if e.Rev <= rev {
				t.Errorf("event at %d, watched from %d", e.Rev, rev+1)
			}
			if seen[e.Key] {
				t.Errorf("%s seen twice", e.Key)
			}
			seen[e.Key] = true
		}
	}
	t.Logf("%d keys listed, %d watched", listed, n-listed)
}

// record is a worker record for the tests.
func record(role membership.Role, url string, inc membership.Incarnation) membership.Record {
	return membership.Record{Role: role, URL: url, Model: "m", Layout: membership.Layout{TP: 1, PP: 1, DP: 1},
		LayoutFingerprint: "fp", Backends: []string{"TCP"}, Incarnation: inc}
}

// changeLog records a View's changes.
type changeLog struct {
	mu      sync.Mutex
	changes []membership.Change
}

func (c *changeLog) add(ch []membership.Change) {
	c.mu.Lock()
	c.changes = append(c.changes, ch...)
	c.mu.Unlock()
}

func (c *changeLog) snapshot() []membership.Change {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.changes)
}

// startView runs a View of cluster over s until the test ends.
func startView(t *testing.T, s membership.Store, clusterName string) (*membership.View, *changeLog) {
	log := &changeLog{}
	v := membership.NewView(s, membership.ViewOptions{Cluster: clusterName, OnChange: log.add, RetryMin: 20 * time.Millisecond, RetryMax: 200 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		v.Run(ctx) //nolint:errcheck // ends with ctx
	}()
	t.Cleanup(func() { cancel(); <-done })
	return v, log
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func urls(ws []membership.WorkerInfo) []string {
	var out []string
	for _, w := range ws {
		out = append(out, w.Record.URL+"#"+w.Record.Incarnation.String())
	}
	return out
}

func newMember(t *testing.T, s membership.Store, clusterName string, rec membership.Record, interval, ttl time.Duration) *membership.Member {
	m, err := membership.NewMember(s, rec, membership.MemberOptions{Cluster: clusterName, Interval: interval, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// testViewConcurrentJoins: workers register while the View starts; it
// ends with all of them, each joined once.
func testViewConcurrentJoins(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	joiner := dial(t, h, h.Addr)
	cl := cluster(t)
	const n = 16
	ttl := max(h.MinTTL, 5*time.Second)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		role := membership.RoleContext
		if i%2 == 1 {
			role = membership.RoleGeneration
		}
		m := newMember(t, joiner, cl, record(role, fmt.Sprintf("http://127.0.0.1:%d", 20000+i), membership.Incarnation(1000+i)), ttl/4, ttl)
		wg.Go(func() {
			time.Sleep(time.Duration(i%6) * time.Millisecond)
			if err := m.Register(ctxFor(t, 10*time.Second)); err != nil {
				errs <- err
			}
		})
	}
	v, log := startView(t, s, cl)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the view has every worker", func() bool { return len(v.Workers("")) == n })
	if c, g := len(v.Workers(membership.RoleContext)), len(v.Workers(membership.RoleGeneration)); c != n/2 || g != n/2 {
		t.Errorf("%d context and %d generation workers, want %d each", c, g, n/2)
	}
	joined := map[string]int{}
	for _, c := range log.snapshot() {
		if c.Kind != membership.Joined {
			t.Errorf("change %v of %s: only joins expected", c.Kind, c.Worker.Key)
		}
		joined[c.Worker.Key]++
	}
	for k, n := range joined {
		if n != 1 {
			t.Errorf("%s joined %d times", k, n)
		}
	}
}

// gated wraps a Store so that the test can hold a View's watch still and
// then resume it from where it was, as a watch that broke and came back
// does.
type gated struct {
	membership.Store
	mu   sync.Mutex
	gate chan struct{} // closed: open
}

func (g *gated) hold() {
	g.mu.Lock()
	g.gate = make(chan struct{})
	g.mu.Unlock()
}

func (g *gated) release() {
	g.mu.Lock()
	close(g.gate)
	g.mu.Unlock()
}

func (g *gated) Watch(ctx context.Context, prefix string, from int64) (membership.Watcher, error) {
	w, err := g.Store.Watch(ctx, prefix, from)
	if err != nil {
		return nil, err
	}
	return &gatedWatcher{g: g, prefix: prefix, next: from, w: w}, nil
}

type gatedWatcher struct {
	g      *gated
	prefix string
	next   int64
	w      membership.Watcher
}

func (w *gatedWatcher) Next(ctx context.Context) ([]membership.Event, error) {
	for {
		w.g.mu.Lock()
		gate := w.g.gate
		w.g.mu.Unlock()
		select {
		case <-gate:
		default:
			// Held: drop the watch; on release, watch again from where
			// it was.
			w.w.Close()
			select {
			case <-gate:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			nw, err := w.g.Store.Watch(ctx, w.prefix, w.next)
			if err != nil {
				return nil, err
			}
			w.w = nw
		}
		nctx, cancel := context.WithCancel(ctx)
		evs, err := w.nextOrHeld(nctx, cancel)
		if err == errHeld {
			continue
		}
		if len(evs) > 0 {
			w.next = evs[len(evs)-1].Rev + 1
		}
		return evs, err
	}
}

var errHeld = errors.New("held")

// nextOrHeld is the inner Next, cut short when the gate is held.
func (w *gatedWatcher) nextOrHeld(ctx context.Context, cancel context.CancelFunc) ([]membership.Event, error) {
	defer cancel()
	done := make(chan struct{})
	defer close(done)
	go func() {
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				w.g.mu.Lock()
				gate := w.g.gate
				w.g.mu.Unlock()
				select {
				case <-gate:
				default:
					cancel()
					return
				}
			}
		}
	}()
	evs, err := w.w.Next(ctx)
	if err != nil && ctx.Err() != nil {
		w.g.mu.Lock()
		gate := w.g.gate
		w.g.mu.Unlock()
		select {
		case <-gate:
		default:
			return nil, errHeld
		}
	}
	return evs, err
}

func (w *gatedWatcher) Close() error { return w.w.Close() }

// testViewResync: while the View's watch is away, a worker joins, one
// leaves and the store compacts its history; when the watch comes back it
// is told ErrCompacted, lists again, and reports exactly the difference.
func testViewResync(t *testing.T, h Harness) {
	inner := dial(t, h, h.Addr)
	g := &gated{Store: inner, gate: make(chan struct{})}
	close(g.gate)
	joiner := dial(t, h, h.Addr)
	cl := cluster(t)
	ttl := max(h.MinTTL, 5*time.Second)
	ctx := ctxFor(t, 30*time.Second)
	a := newMember(t, joiner, cl, record(membership.RoleContext, "http://127.0.0.1:21001", 1), ttl/4, ttl)
	b := newMember(t, joiner, cl, record(membership.RoleGeneration, "http://127.0.0.1:21002", 1), ttl/4, ttl)
	c := newMember(t, joiner, cl, record(membership.RoleGeneration, "http://127.0.0.1:21003", 1), ttl/4, ttl)
	for _, m := range []*membership.Member{a, b} {
		if err := m.Register(ctx); err != nil {
			t.Fatal(err)
		}
	}
	v, log := startView(t, g, cl)
	waitFor(t, 10*time.Second, "a and b in the view", func() bool { return len(v.Workers("")) == 2 })
	g.hold()
	time.Sleep(50 * time.Millisecond) // the watch notices
	if err := c.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Deregister(ctx); err != nil {
		t.Fatal(err)
	}
	_, rev, err := inner.List(ctx, membership.Prefix(cl))
	if err != nil {
		t.Fatal(err)
	}
	h.Compact(t, rev)
	before := len(log.snapshot())
	if got := urls(v.Workers("")); len(got) != 2 || !strings.Contains(got[0], "21001") {
		t.Fatalf("held view changed: %v", got)
	}
	g.release()
	waitFor(t, 10*time.Second, "the view resynced to b and c", func() bool {
		got := urls(v.Workers(""))
		return len(got) == 2 && strings.Contains(got[0], "21002") && strings.Contains(got[1], "21003")
	})
	if st := v.Stats(); st.Resyncs < 1 {
		t.Errorf("stats %+v: want a resync", st)
	}
	after := log.snapshot()[before:]
	var kinds []string
	for _, ch := range after {
		kinds = append(kinds, ch.Kind.String()+" "+ch.Worker.Record.URL)
	}
	want := []string{"left http://127.0.0.1:21001", "joined http://127.0.0.1:21003"}
	if !slices.Equal(kinds, want) {
		t.Errorf("changes after the resync %v, want %v", kinds, want)
	}
}

// testViewStaleDelete: a worker restarted on the same URL is a new
// incarnation; the old incarnation's late delete, and a late put of it,
// leave the new one routed.
func testViewStaleDelete(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	joiner := dial(t, h, h.Addr)
	cl := cluster(t)
	ttl := max(h.MinTTL, 5*time.Second)
	ctx := ctxFor(t, 20*time.Second)
	const url = "http://127.0.0.1:22001"
	v, log := startView(t, s, cl)
	old := newMember(t, joiner, cl, record(membership.RoleGeneration, url, 100), ttl/4, ttl)
	if err := old.Register(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "old joined", func() bool { return len(v.Workers("")) == 1 })
	nw := newMember(t, joiner, cl, record(membership.RoleGeneration, url, 200), ttl/4, ttl)
	if err := nw.Register(ctx); err != nil {
		t.Fatal(err)
	}
	isNew := func() bool {
		w := v.Workers("")
		return len(w) == 1 && w[0].Record.Incarnation == 200
	}
	waitFor(t, 5*time.Second, "the new incarnation replaced the old", isNew)
	if err := old.Deregister(ctx); err != nil { // the old one's delete arrives late
		t.Fatal(err)
	}
	late := newMember(t, joiner, cl, record(membership.RoleGeneration, url, 150), ttl/4, ttl)
	if err := late.Register(ctx); err != nil { // an older incarnation's late put
		t.Fatal(err)
	}
	// Both reach the view: wait until it has seen the late put's revision.
	waitFor(t, 5*time.Second, "the view caught up", func() bool {
		_, rev, err := s.List(ctx, membership.Prefix(cl))
		return err == nil && v.Stats().Rev >= rev
	})
	if !isNew() {
		t.Fatalf("workers %v: want only incarnation 200", urls(v.Workers("")))
	}
	var kinds []string
	for _, ch := range log.snapshot() {
		kinds = append(kinds, fmt.Sprintf("%s %d", ch.Kind, ch.Worker.Record.Incarnation))
	}
	want := []string{"joined 100", "left 100", "joined 200"}
	if !slices.Equal(kinds, want) {
		t.Errorf("changes %v, want %v", kinds, want)
	}
}

// testKeepAliveStalled: replies of the store held back for longer than
// the heartbeat interval (but less than the lease) never evict the
// worker; a store unreachable for longer than the lease does, and the
// worker is back once it is reachable again.
func testKeepAliveStalled(t *testing.T, h Harness) {
	proxy := NewStallProxy(t, h.Addr)
	slow := dial(t, h, proxy.Addr())
	direct := dial(t, h, h.Addr)
	cl := cluster(t)
	ctx := ctxFor(t, 60*time.Second)
	interval, ttl := 500*time.Millisecond, max(h.MinTTL, 2*time.Second)
	m := newMember(t, slow, cl, record(membership.RoleContext, "http://127.0.0.1:23001", 7), interval, ttl)
	if err := m.Register(ctx); err != nil {
		t.Fatal(err)
	}
	kvs, rev, err := direct.List(ctx, membership.Prefix(cl))
	if err != nil || len(kvs) != 1 {
		t.Fatalf("List = %v, %v", kvs, err)
	}
	w, err := direct.Watch(ctx, membership.Prefix(cl), rev+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	events := make(chan []membership.Event, 64)
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			evs, err := w.Next(wctx)
			if err != nil {
				return
			}
			events <- evs
		}
	}()
	defer func() { cancel(); <-done }()

	// Replies late by two intervals, three times in a row.
	stall := 2 * interval
	for range 3 {
		proxy.Stall(stall)
		time.Sleep(stall + interval)
	}
	select {
	case evs := <-events:
		t.Fatalf("the worker's key changed while only replies were slow: %v (status %+v)", evs, m.Status())
	default:
	}
	if st := m.Status(); !st.Registered || st.Reregistrations != 0 || st.Renewals == 0 {
		t.Fatalf("status after slow replies %+v: want registered, renewed, never re-registered", st)
	}
	t.Logf("after slow replies: %+v", m.Status())

	// Unreachable for longer than the lease: evicted, then back.
	proxy.Block(ttl + 2*time.Second)
	var seenDelete, seenPut bool
	deadline := time.After(ttl + 15*time.Second)
	for !seenDelete || !seenPut {
		select {
		case evs := <-events:
			for _, e := range evs {
				switch {
				case e.Type == membership.EventDelete:
					seenDelete = true
				case e.Type == membership.EventPut && seenDelete:
					seenPut = true
				}
			}
		case <-deadline:
			t.Fatalf("delete seen %v, put back seen %v; status %+v", seenDelete, seenPut, m.Status())
		}
	}
	waitFor(t, 5*time.Second, "the member re-registered", func() bool {
		st := m.Status()
		return st.Registered && st.Reregistrations >= 1
	})
}

func testClose(t *testing.T, h Harness) {
	s := h.Dial(t, h.Addr)
	ctx := ctxFor(t, 5*time.Second)
	if _, _, err := s.List(ctx, "/kvxfer/"); err != nil {
		t.Fatal(err)
	}
	// A watcher waiting when the store closes is ended by the Close, not
	// left to wait on (its goroutine and connection with it).
	w, err := s.Watch(ctx, membership.Prefix(cluster(t)), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	next := make(chan error, 1)
	go func() { _, err := w.Next(context.Background()); next <- err }()
	time.Sleep(50 * time.Millisecond) // Next is waiting
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-next:
		if !errors.Is(err, membership.ErrClosed) {
			t.Errorf("Next under way at Close: %v, want ErrClosed", err)
		}
	case <-time.After(3 * time.Second):
		w.Close()
		<-next
		t.Error("Next under way at Close still waiting 3 s after it")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, _, err := s.List(ctx, "/kvxfer/"); !errors.Is(err, membership.ErrClosed) {
		t.Errorf("List after Close: %v, want ErrClosed", err)
	}
}

// testMemberLifecycle: Deregister deletes the record at once (not at the
// lease's end), is idempotent, and ends the Member.
func testMemberLifecycle(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	cl := cluster(t)
	ctx := ctxFor(t, 20*time.Second)
	ttl := max(h.MinTTL, 10*time.Second)
	m := newMember(t, s, cl, record(membership.RoleGeneration, "http://127.0.0.1:24001", 9), ttl/4, ttl)
	if err := m.Register(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Register(ctx); !errors.Is(err, membership.ErrClosed) {
		t.Errorf("second Register: %v, want ErrClosed", err)
	}
	kvs, rev, err := s.List(ctx, membership.Prefix(cl))
	if err != nil || len(kvs) != 1 || kvs[0].Key != m.Key() {
		t.Fatalf("List = %v, %v; want %s", kvs, err, m.Key())
	}
	rec, err := membership.DecodeRecord(kvs[0].Value)
	if err != nil || rec.RegisteredAt.IsZero() || rec.URL != "http://127.0.0.1:24001" {
		t.Fatalf("stored record %+v, %v", rec, err)
	}
	if st := m.Status(); !st.Registered || st.Lease == 0 || kvs[0].Lease != st.Lease {
		t.Errorf("status %+v, key's lease %d", st, kvs[0].Lease)
	}
	w, err := s.Watch(ctx, membership.Prefix(cl), rev+1)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	start := time.Now()
	if err := m.Deregister(ctx); err != nil {
		t.Fatal(err)
	}
	waitEvents(t, w, 5*time.Second, func(evs []membership.Event) bool { return deletes(evs)[m.Key()] })
	if el := time.Since(start); el > ttl/2 {
		t.Errorf("record deleted %v after Deregister: not at once", el)
	}
	if err := m.Deregister(ctx); err != nil {
		t.Errorf("second Deregister: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("Close after Deregister: %v", err)
	}
	if err := m.Register(ctx); !errors.Is(err, membership.ErrClosed) {
		t.Errorf("Register after Deregister: %v, want ErrClosed", err)
	}
	if st := m.Status(); st.Registered {
		t.Errorf("status after Deregister %+v", st)
	}
}

// testJoinLeaveLatency: a View sees a registration and a deregistration
// within a second each (issue #15: a new worker takes traffic within 1 s
// of registering; a worker leaving is dropped at once, not at its lease's
// end).
func testJoinLeaveLatency(t *testing.T, h Harness) {
	s := dial(t, h, h.Addr)
	joiner := dial(t, h, h.Addr)
	cl := cluster(t)
	ctx := ctxFor(t, 20*time.Second)
	ttl := max(h.MinTTL, 10*time.Second)
	v, _ := startView(t, s, cl)
	waitFor(t, 5*time.Second, "the view synced", func() bool { return v.Stats().Synced })
	for i := range 3 {
		m := newMember(t, joiner, cl, record(membership.RoleContext, fmt.Sprintf("http://127.0.0.1:%d", 26000+i), 1), ttl/4, ttl)
		start := time.Now()
		if err := m.Register(ctx); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Second, "the view saw the join within 1 s", func() bool { return len(v.Workers("")) == 1 })
		joined := time.Since(start)
		start = time.Now()
		if err := m.Deregister(ctx); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Second, "the view saw the leave within 1 s", func() bool { return len(v.Workers("")) == 0 })
		t.Logf("join seen after %v, leave after %v", joined.Round(time.Microsecond), time.Since(start).Round(time.Microsecond))
	}
}
