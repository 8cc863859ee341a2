package membership_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// TestViewRecords: what the View makes of records it is given directly:
// an update of the same member, a record that does not decode, a record
// under another member's key, and a role filter.
func TestViewRecords(t *testing.T) {
	s := memstore.New(memstore.Options{})
	defer s.Close()
	ctx := t.Context()
	var mu sync.Mutex
	var got []string
	v := membership.NewView(s, membership.ViewOptions{Cluster: "c", OnChange: func(cs []membership.Change) {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range cs {
			got = append(got, c.Kind.String()+" "+c.Worker.Record.URL)
		}
	}})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); v.Run(rctx) }() //nolint:errcheck // ends with ctx
	defer func() { cancel(); <-done }()

	rec := membership.Record{Role: membership.RoleContext, URL: "http://10.1.1.1:80", Layout: membership.Layout{TP: 1, PP: 1, DP: 1}, Incarnation: 3}
	id, _ := rec.ID()
	key := membership.Key("c", rec.Role, id)
	put := func(key string, r membership.Record) {
		b, err := membership.EncodeRecord(&r)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Put(ctx, key, b, 0); err != nil {
			t.Fatal(err)
		}
	}
	put(key, rec)
	rec.Model = "m2"
	put(key, rec) // same member, new record
	if _, err := s.Put(ctx, membership.Key("c", membership.RoleGeneration, "x_1-0000000000000001"), []byte("{not json"), 0); err != nil {
		t.Fatal(err)
	}
	other := rec
	other.URL = "http://10.1.1.2:80"
	put(membership.Key("c", membership.RoleGeneration, id), other) // record and key disagree
	if _, err := s.Put(ctx, "/kvxfer/c/workers/bogus", []byte("{}"), 0); err != nil {
		t.Fatal(err)
	}
	rev := s.Rev()
	deadline := time.Now().Add(5 * time.Second)
	for v.Stats().Rev < rev && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	st := v.Stats()
	if st.Rev < rev || !st.Synced || st.BadRecords != 3 {
		t.Errorf("stats %+v: want rev %d, synced, 3 bad records", st, rev)
	}
	ws := v.Workers(membership.RoleContext)
	if len(ws) != 1 || ws[0].Record.Model != "m2" || len(v.Workers(membership.RoleGeneration)) != 0 {
		t.Errorf("workers %+v", v.Workers(""))
	}
	all, bad, err := membership.ListWorkers(ctx, s, "c")
	if err != nil || len(all) != 1 || bad != 3 || all[0].Key != key {
		t.Errorf("ListWorkers = %+v, %d, %v", all, bad, err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The first put may be seen by the list or the watch, the second as
	// an update or within the list.
	if !slices.Equal(got, []string{"joined http://10.1.1.1:80", "updated http://10.1.1.1:80"}) && !slices.Equal(got, []string{"joined http://10.1.1.1:80"}) {
		t.Errorf("changes %v", got)
	}
}

// countHandler counts the records logged at Warn or above.
type countHandler struct {
	mu    sync.Mutex
	warns int
}

func (h *countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if r.Level >= slog.LevelWarn {
		h.warns++
	}
	return nil
}
func (h *countHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countHandler) WithGroup(string) slog.Handler      { return h }

// TestViewBadRecordsLogBounded: a flood of records that do not decode
// (anyone who can write to the store) is counted, each one, but logged at
// most about once a second, not once per record and again at each resync.
func TestViewBadRecordsLogBounded(t *testing.T) {
	s := memstore.New(memstore.Options{})
	defer s.Close()
	ctx := t.Context()
	h := &countHandler{}
	v := membership.NewView(s, membership.ViewOptions{Cluster: "c", Logger: slog.New(h)})
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); v.Run(rctx) }() //nolint:errcheck // ends with ctx
	defer func() { cancel(); <-done }()
	const n = 300
	start := time.Now()
	for i := range n {
		if _, err := s.Put(ctx, membership.Key("c", membership.RoleGeneration, fmt.Sprintf("x_%d-%016x", i, i+1)), []byte("{bad"), 0); err != nil {
			t.Fatal(err)
		}
		if i == n/2 {
			s.Compact(s.Rev()) // a resync lists the bad records again
		}
	}
	rev := s.Rev()
	for deadline := time.Now().Add(5 * time.Second); v.Stats().Rev < rev && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if st := v.Stats(); st.BadRecords < n {
		t.Errorf("stats %+v: want at least %d bad records counted", st, n)
	}
	h.mu.Lock()
	warns := h.warns
	h.mu.Unlock()
	if limit := 3 + int(time.Since(start)/time.Second)*2; warns > limit {
		t.Errorf("%d warnings for %d bad records in %v, want at most %d", warns, n, time.Since(start).Round(time.Millisecond), limit)
	}
}

// stallStore is a store whose List never answers until its ctx ends (an
// etcd out of reach: its client waits for a connection without a deadline
// of its own), and counts the calls.
type stallStore struct {
	membership.Store
	mu    sync.Mutex
	lists int
}

func (s *stallStore) List(ctx context.Context, prefix string) ([]membership.KV, int64, error) {
	s.mu.Lock()
	s.lists++
	s.mu.Unlock()
	<-ctx.Done()
	return nil, 0, ctx.Err()
}

// TestViewListStalls: a List that does not answer is bounded: the view
// gives it up, says so and lists again with backoff, rather than wait in
// it, silent, for as long as the store stays out of reach.
func TestViewListStalls(t *testing.T) {
	s := &stallStore{}
	h := &countHandler{}
	v := membership.NewView(s, membership.ViewOptions{Cluster: "c", Logger: slog.New(h), ListTimeout: 100 * time.Millisecond,
		RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond})
	rctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); v.Run(rctx) }() //nolint:errcheck // ends with ctx
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		s.mu.Lock()
		n := s.lists
		s.mu.Unlock()
		if n >= 3 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.mu.Lock()
	n := s.lists
	s.mu.Unlock()
	h.mu.Lock()
	warns := h.warns
	h.mu.Unlock()
	t.Logf("%d lists, %d warnings", n, warns)
	if n < 3 || warns < 1 {
		t.Errorf("%d lists and %d warnings in 3 s: want the stalled list given up and retried, and said", n, warns)
	}
}

// TestViewStoreClosed: a View whose store is closed under it (the router
// closes its built-in store as its stop begins, to end the store's long
// polls) ends its Run with ErrClosed and keeps its last picture, instead
// of listing again, with a warning each time, until its context ends.
func TestViewStoreClosed(t *testing.T) {
	s := memstore.New(memstore.Options{})
	h := &countHandler{}
	v := membership.NewView(s, membership.ViewOptions{Cluster: "c", Logger: slog.New(h),
		RetryMin: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond})
	rec := membership.Record{Role: membership.RoleContext, URL: "http://10.1.1.1:80", Layout: membership.Layout{TP: 1, PP: 1, DP: 1}, Incarnation: 3}
	id, _ := rec.ID()
	b, err := membership.EncodeRecord(&rec)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(t.Context(), membership.Key("c", rec.Role, id), b, 0); err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- v.Run(t.Context()) }()
	for deadline := time.Now().Add(5 * time.Second); len(v.Workers("")) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the view did not list the worker within 5 s")
		}
	}
	s.Close()
	select {
	case err := <-ran:
		if !errors.Is(err, membership.ErrClosed) {
			t.Errorf("Run ended with %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		h.mu.Lock()
		defer h.mu.Unlock()
		t.Fatalf("Run still runs 5 s after its store closed (%d warnings logged)", h.warns)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.warns > 0 {
		t.Errorf("a closed store was logged as %d warnings", h.warns)
	}
	if n := len(v.Workers("")); n != 1 {
		t.Errorf("the view has %d workers after its store closed, want its last picture (1)", n)
	}
}
