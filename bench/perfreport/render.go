package perfreport

import (
	"bytes"
	"fmt"
	"strings"
)

// The README lines between which Splice writes.
const (
	BeginMarker = "<!-- bench-report:begin (written by make bench-report; edits here are lost) -->"
	EndMarker   = "<!-- bench-report:end -->"
)

// Render writes the summary: the targets with their figures and commands,
// then the baselines of the runs with the settings that won.
func Render(ins Inputs, results []Result) string {
	var b strings.Builder
	if ins.Main != nil {
		fmt.Fprintf(&b, "Written by `make bench-report`, started %s at revision %s. ", ins.Main.Started, short(ins.Main.Build.Revision))
	}
	met := 0
	for _, r := range results {
		if r.Met {
			met++
		}
	}
	fmt.Fprintf(&b, "%d of %d targets met in this run. Every ratio divides two figures of one run of the command beside it.", met, len(results))
	if n := rounds(ins); n > 1 {
		fmt.Fprintf(&b, " Each figure of a ratio target is the best of %d rounds, the baselines and kvxfer alternating round by round"+
			" (round k measures every baseline, then kvxfer); the target reads the median of the %d per-round ratios"+
			" (round k's kvxfer over round k's baseline), the best round over the best round given beside it.", n, n)
	}
	b.WriteString("\n\n")
	b.WriteString("| target | measured | met | command |\n|---|---|---|---|\n")
	for _, r := range results {
		ok := "**no**"
		if r.Met {
			ok = "yes"
		}
		cmd := "–"
		if r.Command != "" {
			cmd = "`" + r.Command + "`"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", cell(r.Target), cell(r.Measured), ok, cell(cmd))
	}
	b.WriteString("\nThe baselines, at their best settings, from the same runs:\n\n| run | baseline | GB/s | best setting |\n|---|---|--:|---|\n")
	for _, in := range []struct {
		name string
		rep  *Report
	}{{"identical layouts", ins.Main}, {"context TP2 → generation TP1", ins.TP2}, {"UCX_TLS=tcp", ins.UCXTCP}} {
		if in.rep == nil {
			continue
		}
		for _, bl := range in.rep.Baselines {
			best := bl.Best
			if best == "" {
				best = "–"
			}
			if in.rep.rounds() > 1 && len(bl.Rounds) > 0 {
				var rs []string
				for _, r := range bl.Rounds {
					rs = append(rs, fmt.Sprintf("%.2f", r.GBps))
				}
				best += "; GB/s by round " + strings.Join(rs, " / ")
			}
			fmt.Fprintf(&b, "| %s | %s | %.2f | %s |\n", in.name, bl.Name, bl.GBps, cell(best))
		}
	}
	return b.String()
}

// rounds is the most rounds any of the ratio targets' reports measured
// in (make bench-report gives them all the same).
func rounds(ins Inputs) int {
	n := 0
	for _, r := range []*Report{ins.Main, ins.TP2, ins.UCXTCP} {
		if r != nil {
			n = max(n, r.rounds())
		}
	}
	return n
}

func short(rev string) string {
	if len(rev) > 12 {
		return rev[:12]
	}
	if rev == "" {
		return "(unknown)"
	}
	return rev
}

// cell keeps a table cell on one line and its pipes from ending it.
func cell(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	return strings.ReplaceAll(s, "|", `\|`)
}

// Splice returns readme with the lines between BeginMarker and EndMarker
// replaced by section (SpliceSection).
func Splice(readme []byte, section string) ([]byte, error) {
	return SpliceSection(readme, BeginMarker, EndMarker, section)
}

// SpliceSection returns doc with the lines between the begin and end
// marker lines replaced by section: how make bench-report and make
// bench-reuse each rewrite their part of the README. Each marker must
// stand on a line of its own, once, begin before end; else the error
// wraps ErrInput and says which.
func SpliceSection(doc []byte, begin, end, section string) ([]byte, error) {
	lines := bytes.SplitAfter(doc, []byte("\n"))
	bi, ei := -1, -1
	for i, l := range lines {
		switch strings.TrimSpace(string(l)) {
		case begin:
			if bi >= 0 {
				return nil, fmt.Errorf("%w: the begin marker %q appears twice (lines %d and %d)", ErrInput, begin, bi+1, i+1)
			}
			bi = i
		case end:
			if ei >= 0 {
				return nil, fmt.Errorf("%w: the end marker %q appears twice (lines %d and %d)", ErrInput, end, ei+1, i+1)
			}
			ei = i
		}
	}
	switch {
	case bi < 0 || ei < 0:
		return nil, fmt.Errorf("%w: no %q and %q lines to write between", ErrInput, begin, end)
	case ei < bi:
		return nil, fmt.Errorf("%w: the end marker (line %d) comes before the begin marker (line %d)", ErrInput, ei+1, bi+1)
	}
	var out bytes.Buffer
	for _, l := range lines[:bi+1] {
		out.Write(l)
	}
	out.WriteString(section)
	if !strings.HasSuffix(section, "\n") {
		out.WriteByte('\n')
	}
	for _, l := range lines[ei:] {
		out.Write(l)
	}
	return out.Bytes(), nil
}
