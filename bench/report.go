package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
)

// WriteJSON writes the report as indented JSON (see ReportSchema).
func (r *Report) WriteJSON(w io.Writer) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// WriteTable writes the report as text tables: a line on the setup, the
// baselines when measured, and one row per run. Error messages are not
// included (see WriteErrors).
func (r *Report) WriteTable(w io.Writer) error {
	fmt.Fprintln(w, r.setupLine())
	if len(r.Baselines) > 0 {
		fmt.Fprintln(w)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "BASELINE\tGB/s\tBYTES\tCOMPARED WITH\tNOTE")
		for _, b := range r.Baselines {
			note := baselineNote(b)
			if rs := r.baselineRounds(b); rs != "" {
				note = strings.TrimPrefix(note+"; rounds "+rs, "; ")
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", b.Name, baselineGBps(b), baselineBytes(b),
				strings.Join(b.Backends, ", "), note)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "BACKEND\tUSED\tISL\tCONC\tDTYPE\tBYTES/REQ\tGB/s\tXFER/s\tP50 ms\tP99 ms\tVS BASELINE\tVERIFIED\tERRORS")
	for _, run := range r.Runs {
		c := runCells(run)
		ratios := make([]string, len(run.Ratios))
		for i, ra := range run.Ratios {
			ratios[i] = fmt.Sprintf("%.2fx %s", ra.Ratio, ra.Baseline)
			if m, ok := r.medianRatio(run, ra.Baseline); ok {
				ratios[i] += fmt.Sprintf(" (median of rounds %.2fx)", m)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", run.BackendLabel(), c.used, run.ISL,
			run.Concurrency, run.DType, c.bytesPerReq, c.gbps, c.xfers, c.p50, c.p99, orDash(strings.Join(ratios, ", ")),
			verifiedCell(run), run.Errors)
	}
	return tw.Flush()
}

// WriteErrors writes one line per error of every run.
func (r *Report) WriteErrors(w io.Writer) {
	for _, run := range r.Runs {
		if run.Error != "" {
			fmt.Fprintf(w, "error: %s: %s\n", run.Label(), run.Error)
		}
		for _, m := range run.ErrorMessages {
			fmt.Fprintf(w, "error: %s: %s\n", run.Label(), m)
		}
	}
}

// WriteMarkdown writes the report as a Markdown document: the command
// line, the machine, the setup, the baselines and the runs with their
// ratios to the baselines.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("# kvxfer bench report\n\n")
	fmt.Fprintf(&b, "```\n%s\n```\n\n", strings.Join(r.Command, " "))
	fmt.Fprintf(&b, "Started %s, took %.0f s. %s\n\n", r.Started.Format("2006-01-02 15:04 MST"), r.DurationS, r.setupLine())
	r.mdMachine(&b)
	measured := r.mdBaselines(&b)
	r.mdRuns(&b, measured)
	var errs strings.Builder
	r.WriteErrors(&errs)
	if errs.Len() > 0 {
		b.WriteString("\n## Errors\n\n")
		for line := range strings.Lines(errs.String()) {
			fmt.Fprintf(&b, "- %s\n", mdCell(strings.TrimPrefix(strings.TrimSpace(line), "error: ")))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// mdMachine writes the Machine section: the hardware, the build and the
// environment variables that were set.
func (r *Report) mdMachine(b *strings.Builder) {
	b.WriteString("## Machine\n\n| | |\n|---|---|\n")
	cpu := fmt.Sprintf("%d CPUs", r.Machine.CPUs)
	if r.Machine.CPUModel != "" {
		cpu = fmt.Sprintf("%s, %d CPUs usable", r.Machine.CPUModel, r.Machine.CPUs)
	}
	fmt.Fprintf(b, "| CPU | %s |\n", mdCell(cpu))
	if r.Machine.MemoryBytes > 0 {
		fmt.Fprintf(b, "| Memory | %s |\n", humanBytes(r.Machine.MemoryBytes))
	}
	fmt.Fprintf(b, "| OS/arch | %s/%s |\n", r.Machine.GOOS, r.Machine.GOARCH)
	fmt.Fprintf(b, "| Go | %s |\n", r.Machine.GoVersion)
	build := fmt.Sprintf("%s, revision %s", r.Build.Version, r.Build.Revision)
	if r.Build.Modified {
		build += " (modified)"
	}
	if r.Build.Tags != "" {
		build += ", tags " + r.Build.Tags
	}
	fmt.Fprintf(b, "| kvxfer | %s |\n", mdCell(build))
	if len(r.Config.Env) > 0 {
		var env []string
		for k, v := range r.Config.Env {
			env = append(env, k+"="+v)
		}
		slices.Sort(env)
		fmt.Fprintf(b, "| Environment | `%s` |\n", mdCell(strings.Join(env, " ")))
	}
	b.WriteString("\n")
}

// mdBaselines writes the Baselines section, when there are any, and
// returns the names of those that were measured.
func (r *Report) mdBaselines(b *strings.Builder) (measured []string) {
	if len(r.Baselines) == 0 {
		return nil
	}
	b.WriteString("## Baselines\n\nThe machine's own limits, measured in the same run.\n\n")
	b.WriteString("| baseline | GB/s | bytes | compared with | how |\n|---|--:|--:|---|---|\n")
	for _, bl := range r.Baselines {
		how := bl.Description
		if bl.Command != "" {
			how += ": `" + bl.Command + "`"
		}
		if n := baselineNote(bl); n != "" {
			how += "; " + n
		}
		if v := variantsNote(bl); v != "" {
			how += "; " + v
		}
		if rs := r.baselineRounds(bl); rs != "" {
			how += "; GB/s by round " + rs
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s |\n", bl.Name, baselineGBps(bl), baselineBytes(bl),
			strings.Join(bl.Backends, ", "), mdCell(how))
		if bl.GBps > 0 {
			measured = append(measured, bl.Name)
		}
	}
	b.WriteString("\n")
	return measured
}

// mdRuns writes the Runs table, with a ratio column per measured baseline.
func (r *Report) mdRuns(b *strings.Builder, measured []string) {
	b.WriteString("## Runs\n\nGB/s is 1e9 bytes per second over the measured phase; latency is per request.")
	if n := r.Config.Rounds; n > 1 {
		fmt.Fprintf(b, " Each figure is the best of %d rounds; the baselines and the runs alternate round by round"+
			" (round k measures every baseline, then makes every run, each with its own context process and warm-up),"+
			" and every round tries every setting of a baseline."+
			" A ratio is the best round over the baseline's best round, and in brackets the median of the per-round ratios"+
			" (round k's run over round k's baseline); p50 and p99 are of every round's requests pooled.", n)
	}
	b.WriteString("\n\n")
	b.WriteString("| backend | carried by | ISL | concurrency | dtype | bytes/request | GB/s | transfers/s | p50 ms | p99 ms |")
	for _, m := range measured {
		fmt.Fprintf(b, " vs %s |", m)
	}
	b.WriteString(" verified | errors |")
	if r.Config.Rounds > 1 {
		b.WriteString(" GB/s by round |")
	}
	b.WriteString("\n|---|---|--:|--:|---|--:|--:|--:|--:|--:|")
	for range measured {
		b.WriteString("--:|")
	}
	b.WriteString("---|--:|")
	if r.Config.Rounds > 1 {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	for _, run := range r.Runs {
		c := runCells(run)
		fmt.Fprintf(b, "| %s | %s | %d | %d | %s | %s | %s | %s | %s | %s |", run.BackendLabel(), c.used, run.ISL,
			run.Concurrency, run.DType, c.bytesPerReq, c.gbps, c.xfers, c.p50, c.p99)
		for _, m := range measured {
			cell := "–"
			for _, ra := range run.Ratios {
				if ra.Baseline == m {
					cell = fmt.Sprintf("%.2f×", ra.Ratio)
					if med, ok := r.medianRatio(run, m); ok {
						cell += fmt.Sprintf(" (%.2f×)", med)
					}
				}
			}
			fmt.Fprintf(b, " %s |", cell)
		}
		fmt.Fprintf(b, " %s | %d |", verifiedCell(run), run.Errors)
		if r.Config.Rounds > 1 {
			fmt.Fprintf(b, " %s |", orDash(runRounds(run)))
		}
		b.WriteString("\n")
	}
}

func (r *Report) setupLine() string {
	c := r.Config
	s := fmt.Sprintf("Model %s, context TP%d PP%d, generation TP%d PP%d", c.Model, c.Ctx.TP, c.Ctx.PP, c.Gen.TP, c.Gen.PP)
	if c.MLA {
		s += ", MLA"
	}
	s += fmt.Sprintf(", %d tokens per block; per run %d measured requests after %d warm-up", c.TokensPerBlock, c.Requests, c.Warmup)
	if c.Verify {
		s += "; every byte verified against the naive reference where a request fits it (up to 1 GiB)"
	}
	if slices.Contains(c.TLS, true) {
		s += "; +tls: mutual TLS 1.3 on the control and tcp data connections (not on shm or ucx data)"
	}
	if c.Rounds > 1 {
		s += fmt.Sprintf("; each figure is the best of %d rounds, baselines and runs alternating round by round", c.Rounds)
	}
	return s + "."
}

// medianRatio is run's median of per-round ratios to baseline, when the
// sweep had several rounds.
func (r *Report) medianRatio(run *Result, baseline string) (float64, bool) {
	if r.Config.Rounds <= 1 {
		return 0, false
	}
	for _, m := range run.MedianRoundRatios {
		if m.Baseline == baseline {
			return m.Ratio, true
		}
	}
	return 0, false
}

// runRounds is run's GB/s in each round, "3.10 / 3.42 / failed".
func runRounds(run *Result) string {
	var s []string
	for _, rr := range run.Rounds {
		switch {
		case rr.Error != "":
			s = append(s, "failed")
		case rr.Requests == 0:
			s = append(s, "–")
		default:
			s = append(s, fmt.Sprintf("%.2f", rr.GBps))
		}
	}
	return strings.Join(s, " / ")
}

// baselineRounds is b's GB/s in each round when the sweep had several
// ("" otherwise).
func (r *Report) baselineRounds(b Baseline) string {
	if r.Config.Rounds <= 1 || len(b.Rounds) == 0 {
		return ""
	}
	var s []string
	for _, br := range b.Rounds {
		if br.GBps > 0 {
			s = append(s, fmt.Sprintf("%.2f", br.GBps))
		} else {
			s = append(s, "failed")
		}
	}
	return strings.Join(s, " / ")
}

type cells struct{ used, bytesPerReq, gbps, xfers, p50, p99 string }

func runCells(r *Result) cells {
	if r.Requests == 0 {
		return cells{orDash(r.Backend), "–", "–", "–", "–", "–"}
	}
	return cells{orDash(r.Backend), humanBytes(r.BytesPerReq), fmt.Sprintf("%.2f", r.GBps), fmt.Sprintf("%.1f", r.TransfersPerS),
		fmt.Sprintf("%.1f", r.P50Ms), fmt.Sprintf("%.1f", r.P99Ms)}
}

func verifiedCell(r *Result) string {
	switch r.Verification {
	case VerifyPassed:
		return "yes"
	case VerifyFailed:
		return "NO"
	case VerifySkipped:
		return "skipped (too large)"
	}
	return "–"
}

func baselineGBps(b Baseline) string {
	if b.GBps <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", b.GBps)
}

func baselineBytes(b Baseline) string {
	if b.GBps <= 0 {
		return "–"
	}
	return humanBytes(b.Bytes)
}

func baselineNote(b Baseline) string {
	switch {
	case b.Skipped != "":
		return "skipped: " + b.Skipped
	case b.Error != "":
		return "failed: " + firstLine(b.Error)
	}
	return ""
}

// variantsNote lists the settings a baseline tried, with their figures,
// the winner first: "best -l 1M; tried -l 128K 2.33 GB/s, -l 4M refused".
func variantsNote(b Baseline) string {
	if len(b.Variants) < 2 || b.Best == "" {
		return ""
	}
	var tried []string
	for _, v := range b.Variants {
		switch {
		case v.Setting == b.Best:
		case v.GBps > 0:
			tried = append(tried, fmt.Sprintf("%s %.2f GB/s", v.Setting, v.GBps))
		default:
			tried = append(tried, v.Setting+" failed: "+firstLine(v.Error))
		}
	}
	return "best " + b.Best + "; also tried " + strings.Join(tried, ", ")
}

func orDash(s string) string {
	if s == "" {
		return "–"
	}
	return s
}

// mdCell makes s safe inside a Markdown table cell.
func mdCell(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	return strings.ReplaceAll(s, "|", `\|`)
}

// humanBytes formats n in binary units ("128 MiB", "1.5 GiB").
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	if v == float64(int64(v)) {
		return fmt.Sprintf("%d %ciB", int64(v), "KMGTP"[exp])
	}
	return fmt.Sprintf("%.1f %ciB", v, "KMGTP"[exp])
}

// HumanBytes formats n in binary units ("128 MiB", "1.5 GiB"), as the
// reports of package bench do (for the serving benchmark's reports).
func HumanBytes(n int64) string { return humanBytes(n) }

// MDCell makes s safe inside a Markdown table cell.
func MDCell(s string) string { return mdCell(s) }

// ReadMachine describes this machine as a Report's Machine does.
func ReadMachine() Machine { return readMachine() }
