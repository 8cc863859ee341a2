package membershiptest

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership"
)

// HoldPoll starts a watcher of every key of st whose Next waits in the
// store: on a store reached over HTTP (memstore.Client), a long poll held
// on the server. It returns once the poll has had time to reach the server
// (300 ms) and gives back a channel that receives Next's error when the
// watch ends. The watcher ends with the test at the latest.
func HoldPoll(t testing.TB, st membership.Store) <-chan error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	w, err := st.Watch(ctx, "", 0)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	polled := make(chan error, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := w.Next(ctx); err != nil {
				polled <- err
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		w.Close()
		<-done
	})
	time.Sleep(300 * time.Millisecond)
	return polled
}
