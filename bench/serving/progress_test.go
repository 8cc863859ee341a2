package serving

import (
	"bytes"
	"strings"
	"testing"
)

// TestProgress: without a terminal a line per run's start and end; on a
// terminal a bar redrawn in place, the finished runs' lines above it, and
// nothing left of the bar at the end.
func TestProgress(t *testing.T) {
	res := &Result{Target: Target{Name: TargetAggregated}, Metrics: Metrics{Completed: 3, RequestThroughput: 1.5}}
	events := []Event{
		{Run: 1, Runs: 2, Label: "a", Total: 3},
		{Run: 1, Runs: 2, Label: "a", Done: 2, Total: 3},
		{Run: 1, Runs: 2, Label: "a", Done: 3, Total: 3, Result: res},
		{Run: 2, Runs: 2, Label: "b", Total: 3},
		{Run: 2, Runs: 2, Label: "b", Done: 3, Total: 3, Result: res},
	}
	var plain, term bytes.Buffer
	p, q := NewProgress(&plain, false), NewProgress(&term, true)
	for _, e := range events {
		p(e)
		q(e)
	}
	want := "bench serve: run 1/2 a: started\n" +
		"bench serve: run 1/2 a: 3 completed, 0 failed, 1.50 req/s, 0.0 output tok/s, TTFT p50 0.0 ms, p99 0.0 ms\n" +
		"bench serve: run 2/2 b: started\n" +
		"bench serve: run 2/2 b: 3 completed, 0 failed, 1.50 req/s, 0.0 output tok/s, TTFT p50 0.0 ms, p99 0.0 ms\n"
	if plain.String() != want {
		t.Errorf("plain:\n%q\nwant\n%q", plain.String(), want)
	}
	s := term.String()
	if !strings.Contains(s, " 33%  run 1/2  a  2/3 requests") || strings.Count(s, "completed") != 2 || !strings.HasSuffix(s, "p99 0.0 ms\n") {
		t.Errorf("terminal: %q", s)
	}
}
