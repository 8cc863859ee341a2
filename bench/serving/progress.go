package serving

import (
	"fmt"
	"io"
	"sync"

	"github.com/kvxfer/kvxfer/bench"
)

// NewProgress returns a progress display writing to w: on a terminal a
// bar redrawn in place (package bench's) and a line per finished run;
// otherwise a line per run's start and end. It is safe for concurrent
// use.
func NewProgress(w io.Writer, terminal bool) func(Event) {
	p := &progress{w: w, terminal: terminal}
	return p.event
}

type progress struct {
	mu       sync.Mutex
	w        io.Writer
	terminal bool
	drawn    bool
}

func (p *progress) event(e Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	line := ""
	switch {
	case e.Result != nil:
		m := &e.Result.Metrics
		line = fmt.Sprintf("bench serve: run %d/%d %s: %d completed, %d failed, %.2f req/s, %.1f output tok/s, TTFT p50 %.1f ms, p99 %.1f ms",
			e.Run, e.Runs, e.Label, m.Completed, m.Failed, m.RequestThroughput, m.OutputThroughput, m.TTFT.P50, m.TTFT.P99)
	case e.Done == 0:
		if !p.terminal {
			line = fmt.Sprintf("bench serve: run %d/%d %s: started", e.Run, e.Runs, e.Label)
		}
	}
	if !p.terminal {
		if line != "" {
			fmt.Fprintln(p.w, line)
		}
		return
	}
	if line != "" {
		p.clear()
		fmt.Fprintln(p.w, line)
	}
	if e.Result != nil && e.Run == e.Runs {
		p.clear()
		return
	}
	frac := float64(e.Run-1) / float64(max(e.Runs, 1))
	if e.Total > 0 {
		frac += float64(e.Done) / float64(e.Total) / float64(max(e.Runs, 1))
	}
	if e.Result != nil {
		frac = float64(e.Run) / float64(max(e.Runs, 1))
	}
	// \033[K clears what a longer previous line left behind.
	fmt.Fprintf(p.w, "\r%s %3.0f%%  run %d/%d  %s  %d/%d requests\033[K", bench.Bar(frac), 100*frac, e.Run, e.Runs, e.Label, e.Done, e.Total)
	p.drawn = true
}

func (p *progress) clear() {
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
	}
}
