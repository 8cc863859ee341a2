package engine

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/transceiver"
)

// TestContextFailuresLogRateLimited: when the generation side is gone,
// every held context request fails alike at its deadline; the context
// worker used to log one warning per request. 200 expired requests are
// now a line per second, which count them all; requests released by their owner
// (CancelContext) are no failure and log no warning.
func TestContextFailuresLogRateLimited(t *testing.T) {
	var logs syncbuf.Buffer
	in, err := NewInstance(testModel(t, "tiny-gqa"), InstanceConfig{TokensPerBlock: 8, PoolTokens: 8192})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.NewCacheTransceiver("tcp", 8, config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVTransferTimeoutMs = 200
	log := slog.New(slog.NewTextHandler(&logs, nil))
	tr, err := transceiver.New(context.Background(), cfg, transceiver.Options{State: in.State(), Pools: in.Pools()})
	if err != nil {
		in.Close()
		t.Fatal(err)
	}
	e, err := New(in, Options{Transceiver: tr, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("engine close: %v", err)
		}
	})
	const n = 200
	start := time.Now()
	var streams []*Stream
	for i := range n {
		streams = append(streams, submit(t, e, context.Background(), Request{Type: transceiver.ContextOnly,
			Prompt: prompt(fmt.Sprint("held for nobody ", i)), MaxTokens: 4, IgnoreEOS: true}))
	}
	for i, s := range streams {
		if res := waitResult(t, s); res.Final.ContextPhase == nil {
			t.Fatalf("request %d: %+v", i, res.Final)
		}
	}
	for i := range 10 {
		res := waitResult(t, submit(t, e, context.Background(), Request{Type: transceiver.ContextOnly,
			Prompt: prompt(fmt.Sprint("released ", i)), MaxTokens: 4, IgnoreEOS: true}))
		if res.Final.ContextPhase == nil || !e.CancelContext(res.Final.ContextPhase.CtxRequestID) {
			t.Fatalf("released request %d: %+v", i, res.Final)
		}
	}
	waitPoolsFree(t, e) // every request expired or released
	count := func() (total int, lines []string) {
		for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
			if !strings.Contains(l, "level=WARN") {
				continue
			}
			lines = append(lines, l)
			if !strings.Contains(l, "context transfer failed") || !strings.Contains(l, "cause=timeout") {
				t.Errorf("unexpected warning: %s", l)
			}
			c := 1
			if _, after, ok := strings.Cut(l, "suppressed="); ok {
				// A line that gets through counts itself and those left
				// out before it; an interval's summary counts those only.
				var left int
				fmt.Sscan(after, &left)
				c = left
				if !strings.Contains(l, "interval=") {
					c++
				}
			}
			total += c
		}
		return total, lines
	}
	deadline := time.Now().Add(5 * time.Second)
	total, lines := count()
	for total < n && time.Now().Before(deadline) {
		// An idle scheduler collects ended context transfers at its next
		// iteration.
		e.kick()
		time.Sleep(10 * time.Millisecond)
		total, lines = count()
	}
	// The requests expire over a few seconds (a slow machine prefills
	// them over several): one line per second, and a last summary.
	most := int(time.Since(start)/time.Second) + 2
	if len(lines) > most || len(lines) > n/10 || total != n {
		t.Fatalf("%d warnings counting %d failures in %v, want at most %d counting %d:\n%s", len(lines), total, time.Since(start), most, n, logs.String())
	}
	t.Logf("%d expired context requests: %d warnings", n, len(lines))
}
