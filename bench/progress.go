package bench

import (
	"fmt"
	"io"
	"strings"
	"sync"
)

// Phase is what a progress Event reports.
type Phase string

// The phases of a sweep, in order: each baseline, then for every run its
// start, its batches of warm-up and measured requests, and its end.
const (
	PhaseBaseline Phase = "baseline" // Event.Baseline was measured (or skipped)
	PhaseStart    Phase = "start"    // a run begins
	PhaseWarmup   Phase = "warm-up"  // a batch of warm-up requests finished
	PhaseMeasure  Phase = "measure"  // a batch of measured requests finished
	PhaseDone     Phase = "done"     // a run ended; Event.Result is its row
)

// Event is one step of a benchmark, for progress displays.
type Event struct {
	Phase Phase
	// Run is the 1-based index of the run and Runs the number of runs in
	// the sweep (both 0 for baselines, and when Run is called directly).
	Run, Runs int
	Label     string // the run, as Result.Label
	// Done and Total count the run's requests, warm-up included.
	Done, Total int
	Result      *Result   // with PhaseDone
	Baseline    *Baseline // with PhaseBaseline
	// Round is the 1-based round of a sweep of Rounds rounds
	// (Sweep.Rounds); both 0 when the sweep has one.
	Round, Rounds int
}

// NewProgress returns a progress display writing to w: on a terminal a
// bar redrawn in place (with \r) and a line per finished run; otherwise
// plain lines, one per baseline and two per run. It is safe for
// concurrent use.
func NewProgress(w io.Writer, terminal bool) func(Event) {
	p := &progress{w: w, terminal: terminal}
	return p.event
}

type progress struct {
	mu       sync.Mutex
	w        io.Writer
	terminal bool
	drawn    bool // a bar is on the current line
}

const barWidth = 28

func (p *progress) event(e Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.terminal {
		if line := plainLine(e); line != "" {
			fmt.Fprintln(p.w, line)
		}
		return
	}
	// A finished step prints a permanent line above the bar.
	if line := plainLine(e); line != "" && e.Phase != PhaseStart {
		p.clear()
		fmt.Fprintln(p.w, line)
	}
	if e.Runs == 0 || (e.Phase == PhaseDone && e.Run == e.Runs && e.Round == e.Rounds) {
		p.clear()
		return
	}
	frac := float64(e.Run-1) / float64(e.Runs)
	if e.Total > 0 {
		frac += float64(e.Done) / float64(e.Total) / float64(e.Runs)
	}
	if e.Phase == PhaseDone {
		frac = float64(e.Run) / float64(e.Runs)
	}
	round := ""
	if e.Rounds > 1 {
		frac = (float64(e.Round-1) + frac) / float64(e.Rounds)
		round = fmt.Sprintf("round %d/%d  ", e.Round, e.Rounds)
	}
	bar := Bar(frac)
	step := string(e.Phase)
	if e.Total > 0 && e.Phase != PhaseDone {
		step = fmt.Sprintf("%s %d/%d", e.Phase, e.Done, e.Total)
	}
	// \033[K clears what a longer previous line left behind.
	fmt.Fprintf(p.w, "\r%s %3.0f%%  %srun %d/%d  %s  %s\033[K", bar, 100*frac, round, e.Run, e.Runs, e.Label, step)
	p.drawn = true
}

func (p *progress) clear() {
	if p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
	}
}

// plainLine is the line an event prints without a terminal ("" for none),
// naming its round in a sweep of several.
func plainLine(e Event) string {
	line := eventLine(e)
	if line != "" && e.Rounds > 1 {
		line = strings.Replace(line, "bench: ", fmt.Sprintf("bench: round %d/%d: ", e.Round, e.Rounds), 1)
	}
	return line
}

func eventLine(e Event) string {
	switch e.Phase {
	case PhaseBaseline:
		b := e.Baseline
		switch {
		case b == nil:
			return ""
		case b.Skipped != "":
			return fmt.Sprintf("bench: baseline %s: skipped: %s", b.Name, b.Skipped)
		case b.Error != "":
			return fmt.Sprintf("bench: baseline %s: failed: %s", b.Name, b.Error)
		}
		return fmt.Sprintf("bench: baseline %s: %.2f GB/s over %s", b.Name, b.GBps, humanBytes(b.Bytes))
	case PhaseStart:
		return fmt.Sprintf("bench: run %d/%d %s: started", e.Run, e.Runs, e.Label)
	case PhaseDone:
		r := e.Result
		if r == nil {
			return ""
		}
		if r.Error != "" {
			return fmt.Sprintf("bench: run %d/%d %s: failed: %s", e.Run, e.Runs, e.Label, firstLine(r.Error))
		}
		s := fmt.Sprintf("bench: run %d/%d %s: %.2f GB/s, p50 %.1f ms, p99 %.1f ms over %s", e.Run, e.Runs, e.Label,
			r.GBps, r.P50Ms, r.P99Ms, r.Backend)
		if r.Errors > 0 {
			s += fmt.Sprintf(", %d errors", r.Errors)
		}
		return s
	}
	return ""
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// Bar draws a progress bar of frac (0..1) as the progress display does,
// for other benchmarks' displays.
func Bar(frac float64) string {
	frac = min(1, max(0, frac))
	filled := int(frac*barWidth + 0.5)
	return strings.Repeat("█", filled) + strings.Repeat("░", barWidth-filled)
}
