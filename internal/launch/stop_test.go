package launch

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership/memstore"
)

// TestStopEndsStorePolls: kvxfer up's router serves the built-in store
// of a disagg_cluster; a client of the store in a long poll (a watcher)
// must not hold Stop. Before, Stop waited out the router's 5 s graceful
// shutdown, closing the store only after it.
func TestStopEndsStorePolls(t *testing.T) {
	st := memstore.New(memstore.Options{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: memstore.Handler(st, memstore.HandlerOptions{})}
	l := &Launched{server: srv, closers: []func(){func() { st.Close() }}, log: slog.New(slog.DiscardHandler), dir: t.TempDir()}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(ln)
	}()
	cl, err := memstore.NewClient("http://"+ln.Addr().String(), memstore.ClientOptions{PollWait: memstore.MaxWait})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := cl.Watch(ctx, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	polled := make(chan error, 1)
	go func() {
		for {
			if _, err := w.Next(ctx); err != nil {
				polled <- err
				return
			}
		}
	}()
	time.Sleep(300 * time.Millisecond) // the poll is on the server
	start := time.Now()
	l.Stop()
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Stop took %v with a long poll of the built-in store held, want under 2 s", d.Round(10*time.Millisecond))
	}
	<-served
	select {
	case <-polled:
	case <-time.After(5 * time.Second):
		t.Error("the watcher's poll did not end within 5 s of Stop")
	}
}
