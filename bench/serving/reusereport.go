package serving

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/kvxfer/kvxfer/bench"
)

// MovedOverNewTarget is issue #18's target for the KV moved per turn: at
// most this many times the bytes of the turn's new blocks.
const MovedOverNewTarget = 1.1

// hasReuse reports whether the report has anything to say about prefix
// reuse: prompts that share a prefix (conversations of several turns, a
// system prompt), or a server that reported cached tokens or a path.
func (r *Report) hasReuse() bool {
	if w := r.Config.Workload; w.Turns > 1 || w.SystemPromptLen > 0 {
		return true
	}
	return slices.ContainsFunc(r.Runs, func(run *Result) bool { return run.CachedReported > 0 || len(run.ByPath) > 0 })
}

// WriteReuseTable writes the reuse figures of each run as a text table
// (nothing when the report has none): the prefix-hit rate, the KV moved
// and the new blocks' bytes per request of the follow-up turns, their
// ratio, and TTFT by path; then each run's figures per turn.
func (r *Report) WriteReuseTable(w io.Writer) error {
	if !r.hasReuse() {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "RUN\tPREFIX HIT\tKV MOVED/REQ\tNEW BLOCKS' BYTES/REQ\tMOVED/NEW\tTTFT ms p50/p99\tTTFT ms p50 LOCAL/DISAGG")
	for _, run := range r.Runs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", run.Label(), rateCell(run.PrefixHitRate), bytesMean(run.KVBytes),
			bytesMean(run.NewBlockBytes), ratioCell(run.MovedOverNew), dist2(run.TTFT), pathCell(run.ByPath))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, run := range r.Runs {
		if len(run.PerTurn) < 2 {
			continue
		}
		fmt.Fprintf(w, "\n%s, per turn:\n", run.Label())
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "TURN\tDONE\tPREFIX HIT\tKV MOVED p50/mean\tNEW BLOCKS mean\tNEW BYTES p50/mean\tMOVED/NEW\tTTFT ms p50/p99")
		for _, t := range run.PerTurn {
			fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Turn, t.Completed, rateCell(t.PrefixHitRate), bytesP50Mean(t.KVBytes),
				meanCell(t.NewBlocks), bytesP50Mean(t.NewBytes), ratioCell(t.MovedOverNew), dist2(t.TTFT))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if notes := r.reuseNotes(); len(notes) > 0 {
		fmt.Fprintln(w)
		for _, n := range notes {
			fmt.Fprintln(w, n)
		}
	}
	return nil
}

// reuseNotes say how to read the reuse figures: what the servers did not
// report, and what the bench derived.
func (r *Report) reuseNotes() []string {
	var out []string
	if r.Config.TokensPerBlock > 0 {
		out = append(out, fmt.Sprintf("New blocks: the bench's own count at %d tokens per block, the prompt's blocks beyond the full blocks of the previous turn's prompt and answer (the last answer token has no KV); MOVED/NEW is kv_transfer_bytes over those blocks' bytes, target ≤ %.1f.",
			r.Config.TokensPerBlock, MovedOverNewTarget))
	}
	var noCached, inferred []string
	for _, run := range r.Runs {
		if run.Completed > 0 && run.CachedReported == 0 {
			noCached = append(noCached, run.Label())
		}
		if run.BlockBytesInferred > 0 {
			inferred = append(inferred, fmt.Sprintf("%s (%d of %d requests)", run.Label(), run.BlockBytesInferred, run.Completed))
		}
	}
	if len(noCached) > 0 {
		out = append(out, fmt.Sprintf("No answer reported usage.prompt_tokens_details.cached_tokens, so no prefix-hit rate: %s.", strings.Join(noCached, ", ")))
	}
	if len(inferred) > 0 {
		out = append(out, fmt.Sprintf("kv_block_bytes not reported, so the block size is kv_transfer_bytes over the blocks moved (the server reported no reuse: every block of the prompt): %s.",
			strings.Join(inferred, ", ")))
	}
	return out
}

// writeReuseMarkdown writes the reuse section of the Markdown report.
func (r *Report) writeReuseMarkdown(b *strings.Builder) {
	if !r.hasReuse() {
		return
	}
	b.WriteString("\n## Prefix reuse\n\n")
	b.WriteString("Per request, over the completed ones. Prefix hit: cached prompt tokens (usage.prompt_tokens_details.cached_tokens) over prompt tokens. ")
	b.WriteString("New blocks: the bench's own count, the prompt's blocks beyond the full blocks the previous turn of the conversation left cached (its prompt and answer), times the block size. ")
	fmt.Fprintf(b, "Moved/new: KV moved over those bytes (target ≤ %.1f).\n\n", MovedOverNewTarget)
	b.WriteString("| |")
	for _, run := range r.Runs {
		fmt.Fprintf(b, " %s |", bench.MDCell(run.Label()))
	}
	b.WriteString("\n|---|")
	for range r.Runs {
		b.WriteString("--:|")
	}
	b.WriteString("\n")
	row := func(name string, cell func(*Result) string) {
		fmt.Fprintf(b, "| %s |", name)
		for _, run := range r.Runs {
			fmt.Fprintf(b, " %s |", cell(run))
		}
		b.WriteString("\n")
	}
	row("prefix_hit_rate", func(x *Result) string { return rateCell(x.PrefixHitRate) })
	row("cached / prompt tokens", func(x *Result) string { return fmt.Sprintf("%d / %d", x.CachedTokens, x.TotalInput) })
	row("KV bytes moved per request (mean)", func(x *Result) string { return bytesMean(x.KVBytes) })
	row("new blocks' bytes per request (mean)", func(x *Result) string { return bytesMean(x.NewBlockBytes) })
	row("kv_moved_over_new", func(x *Result) string { return ratioCell(x.MovedOverNew) })
	row("ttft_ms p50 local / disaggregated", func(x *Result) string { return pathCell(x.ByPath) })
	row("ttft_ms p99 local / disaggregated", func(x *Result) string { return pathCellP99(x.ByPath) })
	for _, run := range r.Runs {
		if len(run.PerTurn) < 2 {
			continue
		}
		fmt.Fprintf(b, "\n### %s, per turn\n\n", bench.MDCell(run.Label()))
		b.WriteString("| turn | completed | prefix hit | KV moved p50 / mean | new blocks (mean) | new blocks' bytes p50 / mean | moved / new | ttft_ms p50 / p99 |\n")
		b.WriteString("|--:|--:|--:|--:|--:|--:|--:|--:|\n")
		for _, t := range run.PerTurn {
			fmt.Fprintf(b, "| %d | %d | %s | %s | %s | %s | %s | %s |\n", t.Turn, t.Completed, rateCell(t.PrefixHitRate), bytesP50Mean(t.KVBytes),
				meanCell(t.NewBlocks), bytesP50Mean(t.NewBytes), ratioCell(t.MovedOverNew), ttftCell(t.TTFT))
		}
	}
	if notes := r.reuseNotes(); len(notes) > 0 {
		b.WriteString("\n")
		for _, n := range notes {
			fmt.Fprintf(b, "- %s\n", n)
		}
	}
}

// The README lines between which WriteReuseSummary's section goes
// (perfreport.SpliceSection).
const (
	ReuseBeginMarker = "<!-- bench-reuse:begin (written by make bench-reuse; edits here are lost) -->"
	ReuseEndMarker   = "<!-- bench-reuse:end -->"
)

// WriteReuseSummary writes the README's summary of a reuse comparison:
// one row per run with its prefix-hit rate, KV moved and new blocks'
// bytes per follow-up turn, their ratio, TTFT, TTFT by path, and the
// command that reproduces that row (CommandFor); then what the servers
// did not report.
func (r *Report) WriteReuseSummary(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "Written by `make bench-reuse`, started %s at revision %s, in %.0f s on %d CPUs:\n\n```\n%s\n```\n\n",
		r.Started.UTC().Format("2006-01-02T15:04:05Z"), shortRev(r.Build.Revision), r.DurationS, r.Machine.CPUs, strings.Join(r.Command, " "))
	fmt.Fprintf(&b, "%s\n\n", r.setupLine())
	b.WriteString("Follow-up turns are turns 1 and later; moved/new is their KV moved over the bytes of their new blocks (target ≤ 1.1).\n\n")
	b.WriteString("| run | completed | prefix hit | KV moved / follow-up turn (mean) | new blocks' bytes / follow-up turn (mean) | moved / new | TTFT p50 / p99 ms | TTFT p50 / p99 ms local · disaggregated | load average | command |\n")
	b.WriteString("|---|--:|--:|--:|--:|--:|--:|--:|--:|---|\n")
	for _, run := range r.Runs {
		f := followUps(run)
		fmt.Fprintf(&b, "| %s | %d / %d | %s | %s | %s | %s | %s | %s | %s | `%s` |\n", bench.MDCell(run.Label()), run.Completed,
			run.Completed+run.Failed, rateCell(run.PrefixHitRate), bytesMean(f.KVBytes), bytesMean(f.NewBytes), ratioCell(f.MovedOverNew),
			ttftCell(run.TTFT), pathTTFT(run.ByPath), loadCell(run), bench.MDCell(r.CommandFor(run)))
	}
	if notes := r.reuseNotes(); len(notes) > 0 {
		b.WriteString("\n")
		for _, n := range notes {
			fmt.Fprintf(&b, "- %s\n", bench.MDCell(n))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// followUps sums a run's turns after the first: KV moved and new bytes
// per request (means weighted by requests), and moved over new.
func followUps(run *Result) TurnMetrics {
	var out TurnMetrics
	var kvSum, nbSum, kvN, nbN float64
	var moved, newBytes float64
	for _, t := range run.PerTurn {
		if t.Turn == 0 {
			continue
		}
		kvSum += t.KVBytes.Mean * float64(t.KVBytes.N)
		kvN += float64(t.KVBytes.N)
		nbSum += t.NewBytes.Mean * float64(t.NewBytes.N)
		nbN += float64(t.NewBytes.N)
		if t.MovedOverNew != nil {
			nb := t.NewBytes.Mean * float64(t.NewBytes.N)
			moved += *t.MovedOverNew * nb
			newBytes += nb
		}
	}
	if kvN > 0 {
		out.KVBytes = Dist{Mean: kvSum / kvN, N: int(kvN)}
	}
	if nbN > 0 {
		out.NewBytes = Dist{Mean: nbSum / nbN, N: int(nbN)}
	}
	if newBytes > 0 {
		v := moved / newBytes
		out.MovedOverNew = &v
	}
	return out
}

// CommandFor returns the command that reproduces run alone: the report's
// command with only run's cluster file among several -f, and without the
// flags that write files.
func (r *Report) CommandFor(run *Result) string {
	var out []string
	words := r.Command
	for i := 0; i < len(words); i++ {
		w := words[i]
		name, value, inline := strings.Cut(w, "=")
		switch name {
		case "-f", "--file", "--json", "--md", "--png", "--readme":
			if !inline && i+1 < len(words) {
				value = words[i+1]
				i++
			}
			if (name == "-f" || name == "--file") && (len(r.Config.Targets) < 2 || value == run.Target.Cluster) {
				out = append(out, name, value)
			}
			continue
		}
		out = append(out, w)
	}
	return strings.Join(out, " ")
}

// Merge returns one report of several, in order: their runs side by
// side, under the first one's command, start and configuration, with
// every target and setup.
func Merge(reps ...*Report) *Report {
	if len(reps) == 0 {
		return nil
	}
	out := *reps[0]
	out.Runs = slices.Clone(out.Runs)
	out.Config.Targets = slices.Clone(out.Config.Targets)
	setups := []string{out.Config.Setup}
	for _, o := range reps[1:] {
		out.Runs = append(out.Runs, o.Runs...)
		out.Failed += o.Failed
		out.DurationS += o.DurationS
		out.Config.Targets = append(out.Config.Targets, o.Config.Targets...)
		setups = append(setups, o.Config.Setup)
	}
	out.Config.Setup = strings.Join(setups, "; ")
	return &out
}

func shortRev(rev string) string {
	if len(rev) > 12 {
		return rev[:12]
	}
	return rev
}

func rateCell(v *float64) string {
	if v == nil {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100**v)
}

func ratioCell(v *float64) string {
	if v == nil {
		return "–"
	}
	return fmt.Sprintf("%.2f×", *v)
}

func bytesMean(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return bench.HumanBytes(int64(d.Mean))
}

func bytesP50Mean(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return bench.HumanBytes(int64(d.P50)) + " / " + bench.HumanBytes(int64(d.Mean))
}

func meanCell(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f", d.Mean)
}

func ttftCell(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f / %.1f", d.P50, d.P99)
}

// pathOf returns the figures of path p, if any.
func pathOf(ps []PathMetrics, p string) *PathMetrics {
	for i := range ps {
		if ps[i].Path == p {
			return &ps[i]
		}
	}
	return nil
}

// pathCell is "p50 local / p50 disaggregated (n local / n disaggregated)".
func pathCell(ps []PathMetrics) string {
	if len(ps) == 0 {
		return "–"
	}
	cell := func(p string) (string, int) {
		if m := pathOf(ps, p); m != nil {
			return fmt.Sprintf("%.1f", m.TTFT.P50), m.Completed
		}
		return "–", 0
	}
	l, nl := cell(PathLocal)
	d, nd := cell(PathDisaggregated)
	return fmt.Sprintf("%s / %s (%d / %d)", l, d, nl, nd)
}

func pathCellP99(ps []PathMetrics) string {
	if len(ps) == 0 {
		return "–"
	}
	cell := func(p string) string {
		if m := pathOf(ps, p); m != nil {
			return fmt.Sprintf("%.1f", m.TTFT.P99)
		}
		return "–"
	}
	return cell(PathLocal) + " / " + cell(PathDisaggregated)
}

// pathTTFT is "p50/p99 local · p50/p99 disaggregated" with counts.
func pathTTFT(ps []PathMetrics) string {
	if len(ps) == 0 {
		return "no path header"
	}
	cell := func(p string) string {
		if m := pathOf(ps, p); m != nil {
			return fmt.Sprintf("%.1f / %.1f (%d)", m.TTFT.P50, m.TTFT.P99, m.Completed)
		}
		return "– (0)"
	}
	return cell(PathLocal) + " · " + cell(PathDisaggregated)
}

// loadCell is the load average as a run started → ended.
func loadCell(run *Result) string {
	if run.LoadStart == nil || run.LoadEnd == nil {
		return "–"
	}
	return fmt.Sprintf("%.1f → %.1f", *run.LoadStart, *run.LoadEnd)
}
