package cli

import (
	"encoding/hex"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/membership/connect"
	"github.com/kvxfer/kvxfer/membership/membershiptest"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// TestRouterStopsWithPollHeld: a router that serves the built-in store
// stops at once on SIGTERM while a client of the store is in a long poll
// (a watcher: `kvxfer cluster watch`, or any tool that follows the
// membership). Before, the graceful stop waited for the poll to end on its
// own, which takes up to the client's PollWait (10 s by default), and
// with more such clients up to the stop's own limit.
func TestRouterStopsWithPollHeld(t *testing.T) {
	c := newDynCluster(t, "")
	r := c.startRouter()
	for deadline := time.Now().Add(20 * time.Second); c.info().ClusterName == ""; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the router did not answer /cluster_info within 20 s")
		}
	}
	var secret []byte
	for _, kv := range c.env {
		if v, ok := strings.CutPrefix(kv, "KVXFER_CLUSTER_SECRET="); ok {
			secret, _ = hex.DecodeString(v)
		}
	}
	cl, err := memstore.NewClient(c.routerURL, memstore.ClientOptions{Token: connect.Token(secret), PollWait: memstore.MaxWait})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	polled := membershiptest.HoldPoll(t, cl)
	start := time.Now()
	r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(15 * time.Second):
		t.Fatal("the router did not stop within 15 s of SIGTERM")
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("the router took %v to stop with a long poll held, want under 4 s (10 s before)", d.Round(10*time.Millisecond))
	}
	if logs := r.logs.String(); strings.Contains(logs, "watch broken") {
		t.Errorf("the router's own view warned of the store it closed:\n%s", lastLines(logs, 8))
	}
	if code := r.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("the router exited with status %d on SIGTERM, want 0:\n%s", code, lastLines(r.logs.String(), 5))
	}
	select {
	case err := <-polled:
		t.Logf("the watcher's poll ended: %v", err)
	case <-time.After(5 * time.Second):
		t.Error("the watcher's poll did not end within 5 s of the router stopping")
	}
}
