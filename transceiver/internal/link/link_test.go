package link

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/memnet"
	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// The tests run in testing/synctest bubbles over an in-memory network: a
// context rank's control Plane (announcing shm and tcp on host "h") and
// the Linker of a generation rank in front of its own Plane.

// fakeTr is a data plane that is only ever named: Get hands it out.
type fakeTr struct {
	transport.Transport
	name string
}

func (f *fakeTr) Name() string { return f.name }

// probing is an shm data plane whose probes are counted and answered with
// err, or, when block is set, only when the probe's context ends.
type probing struct {
	fakeTr
	calls atomic.Int32
	err   error
	block bool
}

func (p *probing) Probe(ctx context.Context, endpoint string) error {
	p.calls.Add(1)
	if endpoint != "shm-ep" {
		return errors.New("probed " + endpoint + ", not the peer's shm endpoint")
	}
	if p.block {
		<-ctx.Done()
		return context.Cause(ctx)
	}
	return p.err
}

type nopHandler struct{}

func (nopHandler) Frame(*control.Conn, wire.Frame, bool) error { return nil }
func (nopHandler) Lost(*control.Conn, error)                   {}
func (nopHandler) Busy(*control.Conn) bool                     { return false }

// plane starts a control Plane on nw whose Hello says rank, host and the
// backends with their endpoints; the test closes it.
func plane(t *testing.T, nw *memnet.Network, rank uint32, host string, backends, endpoints []string) *control.Plane {
	t.Helper()
	ln, err := nw.Listen("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	p := control.New(control.Config{Listener: ln, Dial: nw.Dial, Name: "link test", Log: slog.New(slog.DiscardHandler),
		Hello: wire.Hello{Version: wire.Version, Rank: rank, Host: host, Backends: backends, Endpoints: endpoints}}, nopHandler{})
	p.Start()
	t.Cleanup(func() { p.Close() })
	return p
}

// setup returns the context rank's endpoint, the generation rank's Plane
// and a Linker on it with want, on host, with shm (sh) and tcp open.
func setup(t *testing.T, want, host string, sh *probing) (string, *control.Plane, *Linker) {
	nw := memnet.New()
	srv := plane(t, nw, 3, "h", []string{"shm", "tcp"}, []string{"shm-ep", "tcp-ep"})
	cli := plane(t, nw, 0, host, []string{"shm", "tcp"}, []string{"my-shm", "my-tcp"})
	sh.name = "shm"
	k := New(Config{Plane: cli, Want: want, Auto: autoOrder, Host: host,
		Transports: map[string]transport.Transport{"shm": sh, "tcp": &fakeTr{name: "tcp"}}})
	t.Cleanup(k.Close)
	return srv.Endpoint(), cli, k
}

// TestGetProbesOncePerConnection: without wait, Get neither dials nor
// probes; with it, it dials and probes once; the connection then keeps
// the answer, so a Get without wait finds both and chooses the same.
func TestGetProbesOncePerConnection(t *testing.T) {
	for _, tc := range []struct {
		name     string
		probeErr error
		want     string
	}{
		{"shm reached", nil, "shm"},
		{"shm unreachable: tcp", errors.New("another mount namespace"), "tcp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				sh := &probing{err: tc.probeErr}
				ep, cli, k := setup(t, "auto", "h", sh)
				if _, ok, err := k.Get(t.Context(), ep, false); ok || err != nil {
					t.Fatalf("Get without wait, nothing dialled: ok %v err %v; want false, nil", ok, err)
				}
				if cli.Dialled() != 0 || sh.calls.Load() != 0 {
					t.Fatalf("Get without wait dialled (%d) or probed (%d)", cli.Dialled(), sh.calls.Load())
				}
				l, ok, err := k.Get(t.Context(), ep, true)
				if !ok || err != nil {
					t.Fatalf("Get with wait: ok %v err %v", ok, err)
				}
				if l.Backend != tc.want || l.Transport.Name() != tc.want || l.Conn.Peer().Rank != 3 {
					t.Fatalf("Get with wait: backend %q over %q to rank %d; want %q to rank 3", l.Backend, l.Transport.Name(), l.Conn.Peer().Rank, tc.want)
				}
				l.Release()
				again, ok, err := k.Get(t.Context(), ep, false)
				if !ok || err != nil || again.Conn != l.Conn || again.Backend != tc.want {
					t.Fatalf("Get without wait after one with: ok %v err %v same conn %v backend %q", ok, err, again.Conn == l.Conn, again.Backend)
				}
				again.Release()
				if n := sh.calls.Load(); n != 1 {
					t.Fatalf("%d probes for one connection, want 1", n)
				}
			})
		})
	}
}

// TestGetWaitsForProbe: a connection up but not probed yet is no link
// without wait (a probe would wait); with wait the probe runs.
func TestGetWaitsForProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sh := &probing{}
		ep, cli, k := setup(t, "auto", "h", sh)
		cc, release, err := cli.Dial(t.Context(), ep)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		if _, ok, err := k.Get(t.Context(), ep, false); ok || err != nil || sh.calls.Load() != 0 {
			t.Fatalf("Get without wait, probe not run: ok %v err %v probes %d; want false, nil, 0", ok, err, sh.calls.Load())
		}
		l, ok, err := k.Get(t.Context(), ep, true)
		if !ok || err != nil || l.Conn != cc || l.Backend != "shm" {
			t.Fatalf("Get with wait: ok %v err %v same conn %v backend %q", ok, err, l.Conn == cc, l.Backend)
		}
		l.Release()
	})
}

// TestGetNoProbe: no probe where the choice does not need one.
func TestGetNoProbe(t *testing.T) {
	for _, tc := range []struct{ name, want, host, backend string }{
		{"another host", "auto", "other", "tcp"},
		{"shm configured", "shm", "h", "shm"},
		{"tcp configured", "tcp", "h", "tcp"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				sh := &probing{}
				ep, _, k := setup(t, tc.want, tc.host, sh)
				l, ok, err := k.Get(t.Context(), ep, true)
				if !ok || err != nil || l.Backend != tc.backend {
					t.Fatalf("ok %v err %v backend %q; want %q", ok, err, l.Backend, tc.backend)
				}
				l.Release()
				if sh.calls.Load() != 0 {
					t.Fatalf("%d probes, want none", sh.calls.Load())
				}
			})
		})
	}
}

// TestReach: Reach hands the link over on the caller's goroutine when the
// connection is cached and needs no probe, and on the goroutine start
// runs it on when it must dial or probe; a failure reaches done as well.
func TestReach(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sh := &probing{}
		ep, _, k := setup(t, "auto", "h", sh)
		type got struct {
			l   Link
			err error
		}
		var starts int
		start := func(f func()) { starts++; go f() }
		out := make(chan got, 1)
		done := func(l Link, err error) { out <- got{l, err} }
		k.Reach(t.Context(), ep, start, done) // nothing cached: dial and probe
		synctest.Wait()
		if g := <-out; g.err != nil || g.l.Backend != "shm" || starts != 1 || sh.calls.Load() != 1 {
			t.Fatalf("first Reach: backend %q err %v, %d goroutines started, %d probes; want shm, nil, 1, 1", g.l.Backend, g.err, starts, sh.calls.Load())
		} else {
			g.l.Release()
		}
		k.Reach(t.Context(), ep, start, done) // cached and probed: on this goroutine
		select {
		case g := <-out:
			if g.err != nil || g.l.Backend != "shm" || starts != 1 {
				t.Fatalf("second Reach: backend %q err %v, %d goroutines started; want shm, nil, still 1", g.l.Backend, g.err, starts)
			}
			g.l.Release()
		default:
			t.Fatal("Reach of a cached, probed connection did not hand the link over before returning")
		}
		k.Reach(t.Context(), "127.0.0.1:1", start, done) // nobody listening
		synctest.Wait()
		if g := <-out; g.err == nil || starts != 2 {
			t.Fatalf("Reach of a dead endpoint: err %v after %d starts; want an error after 2", g.err, starts)
		}
	})
}

// TestGetFails: a failed dial and no data plane in common are errors,
// with ok true (nothing to wait for).
func TestGetFails(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ep, _, k := setup(t, "ucx", "h", &probing{})
		if _, ok, err := k.Get(t.Context(), ep, true); !ok || !errors.Is(err, transport.ErrNotBuilt) {
			t.Fatalf("ucx configured, neither rank has it: ok %v err %v; want true, ErrNotBuilt", ok, err)
		}
		if _, ok, err := k.Get(t.Context(), "127.0.0.1:1", true); !ok || err == nil {
			t.Fatalf("nobody listening: ok %v err %v; want true and an error", ok, err)
		}
	})
}

// TestProbeEndsAtClose: a probe that never answers ends when the Linker
// closes, at once, and the pair falls back to tcp; Close is idempotent.
func TestProbeEndsAtClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sh := &probing{block: true}
		ep, _, k := setup(t, "auto", "h", sh)
		start := time.Now()
		got := make(chan Link)
		go func() {
			l, ok, err := k.Get(t.Context(), ep, true)
			if !ok || err != nil {
				t.Errorf("ok %v err %v", ok, err)
			}
			got <- l
		}()
		synctest.Wait() // the probe waits
		if sh.calls.Load() != 1 {
			t.Fatalf("%d probes running, want 1", sh.calls.Load())
		}
		k.Close()
		k.Close()
		l := <-got
		if l.Backend != "tcp" || time.Since(start) != 0 {
			t.Fatalf("backend %q after %v; want tcp at once", l.Backend, time.Since(start))
		}
		l.Release()
	})
}

// TestProbeTimeout: a probe that never answers gives up after
// ProbeTimeout, on the bubble's clock.
func TestProbeTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		sh := &probing{block: true}
		ep, _, k := setup(t, "auto", "h", sh)
		start := time.Now()
		l, ok, err := k.Get(t.Context(), ep, true)
		if !ok || err != nil || l.Backend != "tcp" {
			t.Fatalf("ok %v err %v backend %q; want tcp", ok, err, l.Backend)
		}
		if d := time.Since(start); d != ProbeTimeout {
			t.Fatalf("Get took %v, want the probe timeout %v", d, ProbeTimeout)
		}
		l.Release()
	})
}
