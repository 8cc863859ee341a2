package serving

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/internal/buildinfo"
)

// ReportVersion is the version of the JSON report (report_version).
const ReportVersion = 1

// Report is the outcome of a sweep: a run per rate and target.
type Report struct {
	Version   int            `json:"report_version"`
	Command   []string       `json:"command"`
	Started   time.Time      `json:"started"`
	DurationS float64        `json:"duration_s"`
	Build     buildinfo.Info `json:"build"`
	Machine   bench.Machine  `json:"machine"`
	Config    Config         `json:"config"`
	Runs      []*Result      `json:"runs"`
	// Failed is the sum of the runs' failed requests.
	Failed int `json:"failed"`
	// PairedTTFTDeltaMs is, for a paired sweep of a disaggregated and an
	// aggregated target, the TTFT of each request through the first minus
	// that of the same request to the second, over the requests both
	// completed: the disaggregation overhead, request by request.
	PairedTTFTDeltaMs *Delta `json:"paired_ttft_delta_ms,omitempty"`
}

// Delta summarizes differences, which may be negative.
type Delta struct {
	Mean float64 `json:"mean"`
	P10  float64 `json:"p10"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	N    int     `json:"n"`
}

// pairedDelta is the Delta of disaggregated minus aggregated TTFT over
// the requests (conversation and turn) that both completed.
func pairedDelta(dis, agg []Record) *Delta {
	type key struct{ c, t int }
	aggTTFT := map[key]float64{}
	for _, r := range agg {
		if r.OK() {
			aggTTFT[key{r.Conversation, r.Turn}] = ms(r.TTFT)
		}
	}
	var diffs []float64
	for _, r := range dis {
		if a, ok := aggTTFT[key{r.Conversation, r.Turn}]; ok && r.OK() {
			diffs = append(diffs, ms(r.TTFT)-a)
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	d := Summarize(diffs)
	return &Delta{Mean: d.Mean, P10: Percentile(diffs, 10), P50: d.P50, P90: d.P90, N: d.N}
}

// Config is the effective configuration of a sweep.
type Config struct {
	Workload Workload `json:"workload"`
	Model    string   `json:"model"`
	// Rates are the request rates of the sweep, one run per rate and
	// target; 0 means all at once.
	Rates      []float64 `json:"rates"`
	Burstiness float64   `json:"burstiness"`
	// Paired: each conversation went to every target in turn, one
	// request at a time (RunPaired), rather than a run per target.
	Paired bool `json:"paired"`
	// Warmup is the unmeasured requests before each run.
	Warmup         int `json:"warmup"`
	MaxConcurrency int `json:"max_concurrency"`
	// DurationS bounds each run (0: none); TimeoutS each request.
	DurationS float64 `json:"duration_s"`
	TimeoutS  float64 `json:"timeout_s"`
	SLO       SLO     `json:"slo"`
	// Targets are what the runs measured.
	Targets []Target `json:"targets"`
	// Setup says where the targets came from: the cluster kvxfer started
	// or the URLs given.
	Setup string `json:"setup"`
	// TokensPerBlock is the block size of the bench's own count of new
	// blocks (0: none counted); ConversationField where each request
	// carried its conversation's id.
	TokensPerBlock    int    `json:"tokens_per_block"`
	ConversationField string `json:"conversation_id_field"`
}

// Result is one run: a target at a rate.
type Result struct {
	Target Target `json:"target"`
	// Rate is the rate asked for (0: all at once).
	Rate           float64 `json:"request_rate_asked"`
	MaxConcurrency int     `json:"max_concurrency"`
	Metrics
	// ErrorExamples holds the first message of each kind of error.
	ErrorExamples map[string]string `json:"error_examples"`
	// Error says why the run could not run at all ("" when it ran).
	Error string `json:"error,omitempty"`
	// LoadStart and LoadEnd are the machine's 1-minute load average as
	// the run started and ended (nil where it cannot be read): a run on a
	// machine busy with other work measures queueing, not serving.
	LoadStart *float64 `json:"load_average_start,omitempty"`
	LoadEnd   *float64 `json:"load_average_end,omitempty"`

	records []Record
}

// Label names the run: its target and its load, the rate or, for one
// that starts everything at once, the concurrency.
func (r *Result) Label() string {
	return r.Target.Short() + " @ " + loadText(r.Rate, r.MaxConcurrency)
}

// loadText is a run's load: "4/s", "4/s, concurrency 8", "concurrency 1"
// or "all at once".
func loadText(rate float64, maxc int) string {
	switch {
	case rate > 0 && !math.IsInf(rate, 1) && maxc > 0:
		return fmt.Sprintf("%s, concurrency %d", rateText(rate), maxc)
	case rate > 0 && !math.IsInf(rate, 1):
		return rateText(rate)
	case maxc > 0:
		return fmt.Sprintf("concurrency %d", maxc)
	}
	return "all at once"
}

func rateText(rate float64) string {
	if rate <= 0 || math.IsInf(rate, 1) {
		return "inf"
	}
	return strconv.FormatFloat(rate, 'g', 4, 64) + "/s"
}

// Event is one step of a sweep, for progress displays.
type Event struct {
	Run, Runs   int // 1-based
	Label       string
	Done, Total int     // requests of the run
	Result      *Result // when the run ended
}

// Sweep is a sweep: Base with each rate, against each target.
type Sweep struct {
	Base    Options
	Targets []Target
	Rates   []float64
	Command []string
	Setup   string
	// Paired runs each rate as RunPaired does: every conversation to
	// every target in turn, one request at a time (Rates must be {0}).
	Paired bool
	// Progress, when set, receives the sweep's events.
	Progress func(Event)
}

// RunSweep runs every rate against every target, the targets of a rate
// one after the other with the same workload (the same seed), and
// returns the report. An error is returned only for options that cannot
// run; a run that fails is in the report.
func RunSweep(ctx context.Context, s Sweep) (*Report, error) {
	if len(s.Targets) == 0 || len(s.Rates) == 0 {
		return nil, fmt.Errorf("%w: a sweep needs a target and a rate", ErrBadOptions)
	}
	for _, t := range s.Targets {
		o := s.Base
		o.Target = t
		if err := o.validate(); err != nil {
			return nil, err
		}
	}
	b := s.Base
	timeout := b.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	rep := &Report{Version: ReportVersion, Command: s.Command, Started: time.Now(), Build: buildinfo.Read(),
		Machine: bench.ReadMachine(), Runs: []*Result{},
		Config: Config{Workload: b.Workload, Model: b.Model, Rates: s.Rates, Burstiness: b.Burstiness, Warmup: b.Warmup, Paired: s.Paired,
			MaxConcurrency: b.MaxConcurrency, DurationS: b.Duration.Seconds(), TimeoutS: timeout.Seconds(), SLO: b.SLO,
			Targets: s.Targets, Setup: s.Setup, TokensPerBlock: b.TokensPerBlock, ConversationField: cmp.Or(b.ConversationField, ConversationFieldTop)}}
	if s.Paired {
		if len(s.Rates) != 1 || s.Rates[0] != 0 {
			return nil, fmt.Errorf("%w: a paired sweep sends one request at a time: it has no rate (rates %v)", ErrBadOptions, s.Rates)
		}
		rep.Config.MaxConcurrency = 1
		runPaired(ctx, s, rep)
		return rep, nil
	}
	runs := len(s.Rates) * len(s.Targets)
	for _, rate := range s.Rates {
		for _, t := range s.Targets {
			if ctx.Err() != nil {
				break
			}
			o := s.Base
			o.Target, o.Rate = t, rate
			n := len(rep.Runs) + 1
			res := &Result{Target: t, Rate: rate, MaxConcurrency: o.MaxConcurrency}
			label := res.Label()
			if s.Progress != nil {
				s.Progress(Event{Run: n, Runs: runs, Label: label, Total: o.Workload.NumPrompts})
				o.Progress = func(done, total int) {
					s.Progress(Event{Run: n, Runs: runs, Label: label, Done: done, Total: total})
				}
			}
			res.LoadStart = loadAverage()
			records, d, err := Run(ctx, o)
			res.LoadEnd = loadAverage()
			res.Metrics = Compute(records, d, o.SLO)
			res.records = records
			res.ErrorExamples = map[string]string{}
			for _, r := range records {
				if !r.OK() && res.ErrorExamples[r.ErrorKind] == "" {
					res.ErrorExamples[r.ErrorKind] = r.Error
				}
			}
			if err != nil {
				res.Error = err.Error()
			}
			rep.Runs = append(rep.Runs, res)
			rep.Failed += res.Failed
			if s.Progress != nil {
				s.Progress(Event{Run: n, Runs: runs, Label: label, Done: len(records), Total: o.Workload.NumPrompts, Result: res})
			}
		}
	}
	rep.DurationS = time.Since(rep.Started).Seconds()
	if rep.Command == nil {
		rep.Command = []string{}
	}
	return rep, nil
}

// runPaired runs a paired sweep (Sweep.Paired) into rep: one Result per
// target, from the records of one RunPaired.
func runPaired(ctx context.Context, s Sweep, rep *Report) {
	label := "all targets, paired"
	o := s.Base
	if s.Progress != nil {
		s.Progress(Event{Run: 1, Runs: 1, Label: label, Total: o.Workload.NumPrompts * len(s.Targets)})
		o.Progress = func(done, total int) { s.Progress(Event{Run: 1, Runs: 1, Label: label, Done: done, Total: total}) }
	}
	records, spent, err := RunPaired(ctx, o, s.Targets)
	done := 0
	for i, t := range s.Targets {
		res := &Result{Target: t, MaxConcurrency: 1, ErrorExamples: map[string]string{}}
		if err != nil {
			res.Error = err.Error()
			res.Metrics = Compute(nil, 0, o.SLO)
		} else {
			res.records = records[i]
			res.Metrics = Compute(records[i], spent[i], o.SLO)
			done += len(records[i])
		}
		for _, r := range res.records {
			if !r.OK() && res.ErrorExamples[r.ErrorKind] == "" {
				res.ErrorExamples[r.ErrorKind] = r.Error
			}
		}
		rep.Runs = append(rep.Runs, res)
		rep.Failed += res.Failed
	}
	if err == nil && len(s.Targets) == 2 && s.Targets[0].Name == TargetDisaggregated && s.Targets[1].Name == TargetAggregated {
		rep.PairedTTFTDeltaMs = pairedDelta(records[0], records[1])
	}
	if s.Progress != nil {
		s.Progress(Event{Run: 1, Runs: 1, Label: label, Done: done, Total: o.Workload.NumPrompts * len(s.Targets), Result: rep.Runs[0]})
	}
	rep.DurationS = time.Since(rep.Started).Seconds()
	if rep.Command == nil {
		rep.Command = []string{}
	}
}

// OK reports whether the run ran and every request completed.
func (r *Result) OK() bool { return r.Error == "" && r.Failed == 0 && r.Completed > 0 }

// FailedRuns reports whether any run failed or had a failed request: the
// exit status of kvxfer bench serve is 1 then.
func (r *Report) FailedRuns() bool {
	return slices.ContainsFunc(r.Runs, func(run *Result) bool { return !run.OK() })
}

// WriteJSON writes the report as indented JSON (see ReportSchema).
func (r *Report) WriteJSON(w io.Writer) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// WriteTable writes the report as a text table: a line on the setup and
// one row per run; then the disaggregation overhead where the sweep has
// both a disaggregated and an aggregated run at a rate.
func (r *Report) WriteTable(w io.Writer) error {
	fmt.Fprintln(w, r.setupLine())
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TARGET\tRATE\tCONC\tDONE\tFAILED\tREQ/s\tOUT TOK/s\tGOODPUT\tTTFT ms p50/p90/p99\tTPOT ms p50/p99\tITL ms p50/p99\tE2EL ms p50/p99\tKV/REQ\tKV SHARE OF TTFT p50")
	for _, run := range r.Runs {
		m := &run.Metrics
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%.2f\t%.1f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", run.Target.Short(), rateText(run.Rate),
			concText(run.MaxConcurrency), m.Completed,
			m.Failed, m.RequestThroughput, m.OutputThroughput, goodputCell(m), dist3(m.TTFT), dist2(m.TPOT), dist2(m.ITL),
			dist2(m.E2EL), kvBytesCell(m), kvShareCell(m))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if lines := r.overheadLines(); len(lines) > 0 {
		fmt.Fprintln(w)
		for _, l := range lines {
			fmt.Fprintln(w, l)
		}
	}
	if r.hasReuse() {
		fmt.Fprintln(w)
	}
	return r.WriteReuseTable(w)
}

// WriteErrors writes one line per kind of error of every run, with its
// count and first message.
func (r *Report) WriteErrors(w io.Writer) {
	for _, run := range r.Runs {
		if run.Error != "" {
			fmt.Fprintf(w, "error: %s: %s\n", run.Label(), run.Error)
		}
		for _, k := range slices.Sorted(maps.Keys(run.ErrorsByKind)) {
			fmt.Fprintf(w, "error: %s: %d× %s: %s\n", run.Label(), run.ErrorsByKind[k], k, run.ErrorExamples[k])
		}
	}
}

// WriteMarkdown writes the report as a Markdown document: the command,
// the machine, the setup, and the runs side by side (a column each).
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("# kvxfer bench serve report\n\n")
	fmt.Fprintf(&b, "```\n%s\n```\n\n", strings.Join(r.Command, " "))
	fmt.Fprintf(&b, "Started %s, took %.0f s. %s\n\n", r.Started.Format("2006-01-02 15:04 MST"), r.DurationS, r.setupLine())
	m := r.Machine
	cpu := fmt.Sprintf("%d CPUs", m.CPUs)
	if m.CPUModel != "" {
		cpu = fmt.Sprintf("%s, %d CPUs usable", m.CPUModel, m.CPUs)
	}
	build := r.Build.Version + ", revision " + r.Build.Revision
	if r.Build.Modified {
		build += " (modified)"
	}
	fmt.Fprintf(&b, "Machine: %s, %s/%s, %s; kvxfer %s.\n\n", bench.MDCell(cpu), m.GOOS, m.GOARCH, m.GoVersion, bench.MDCell(build))
	b.WriteString("## Runs\n\nTimes in ms; throughput per second of the run.\n\n| |")
	for _, run := range r.Runs {
		fmt.Fprintf(&b, " %s |", bench.MDCell(run.Label()))
	}
	b.WriteString("\n|---|")
	for range r.Runs {
		b.WriteString("--:|")
	}
	b.WriteString("\n")
	row := func(name string, cell func(*Result) string) {
		fmt.Fprintf(&b, "| %s |", name)
		for _, run := range r.Runs {
			fmt.Fprintf(&b, " %s |", cell(run))
		}
		b.WriteString("\n")
	}
	row("completed / failed", func(x *Result) string { return fmt.Sprintf("%d / %d", x.Completed, x.Failed) })
	row("request_throughput (req/s)", func(x *Result) string { return fmt.Sprintf("%.2f", x.RequestThroughput) })
	row("output_throughput (tok/s)", func(x *Result) string { return fmt.Sprintf("%.1f", x.OutputThroughput) })
	row("goodput (req/s)", func(x *Result) string { return goodputCell(&x.Metrics) })
	for _, d := range []struct {
		name string
		get  func(*Metrics) Dist
	}{{"ttft_ms", func(m *Metrics) Dist { return m.TTFT }}, {"tpot_ms", func(m *Metrics) Dist { return m.TPOT }},
		{"itl_ms", func(m *Metrics) Dist { return m.ITL }}, {"e2el_ms", func(m *Metrics) Dist { return m.E2EL }}} {
		row(d.name+" mean", func(x *Result) string { return msCell(d.get(&x.Metrics).Mean, d.get(&x.Metrics).N) })
		for _, p := range []struct {
			name string
			get  func(Dist) float64
		}{{"p50", func(d Dist) float64 { return d.P50 }}, {"p90", func(d Dist) float64 { return d.P90 }}, {"p99", func(d Dist) float64 { return d.P99 }}} {
			row(d.name+" "+p.name, func(x *Result) string { dd := d.get(&x.Metrics); return msCell(p.get(dd), dd.N) })
		}
	}
	row("KV bytes per request (mean)", func(x *Result) string { return kvBytesCell(&x.Metrics) })
	row("kv_transfer_ms p50 / p99", func(x *Result) string {
		return msCell(x.KVTransferMs.P50, x.KVTransferMs.N) + " / " + msCell(x.KVTransferMs.P99, x.KVTransferMs.N)
	})
	row("KV share of TTFT (p50)", func(x *Result) string { return kvShareCell(&x.Metrics) })
	row("load average (start → end)", loadCell)
	if lines := r.overheadLines(); len(lines) > 0 {
		b.WriteString("\n")
		for _, l := range lines {
			fmt.Fprintf(&b, "- %s\n", l)
		}
	}
	r.writeReuseMarkdown(&b)
	var errs strings.Builder
	r.WriteErrors(&errs)
	if errs.Len() > 0 {
		b.WriteString("\n## Errors\n\n")
		for line := range strings.Lines(errs.String()) {
			fmt.Fprintf(&b, "- %s\n", bench.MDCell(strings.TrimPrefix(strings.TrimSpace(line), "error: ")))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// overheadLines compare, at each rate with both, the disaggregated run's
// TTFT p50 with the aggregated one's.
func (r *Report) overheadLines() []string {
	var out []string
	for _, rate := range r.Config.Rates {
		var dis, agg *Result
		for _, run := range r.Runs {
			if run.Rate != rate || run.Completed == 0 {
				continue
			}
			switch run.Target.Name {
			case TargetDisaggregated:
				dis = run
			case TargetAggregated:
				agg = run
			}
		}
		if dis == nil || agg == nil {
			continue
		}
		out = append(out, fmt.Sprintf("disaggregation overhead @ %s: TTFT p50 %+.1f ms (%.1f disaggregated − %.1f aggregated); KV transfer p50 %.2f ms, %s per request",
			r.overheadLoad(rate), dis.TTFT.P50-agg.TTFT.P50, dis.TTFT.P50, agg.TTFT.P50, dis.KVTransferMs.P50, kvBytesCell(&dis.Metrics)))
		if d := r.PairedTTFTDeltaMs; d != nil {
			out = append(out, fmt.Sprintf("request by request (%d pairs), TTFT disaggregated − aggregated: p50 %+.1f ms, p10 %+.1f ms, p90 %+.1f ms, mean %+.1f ms",
				d.N, d.P50, d.P10, d.P90, d.Mean))
		}
	}
	return out
}

// overheadLoad names the load of an overhead line.
func (r *Report) overheadLoad(rate float64) string {
	if r.Config.Paired {
		return "concurrency 1, paired"
	}
	return loadText(rate, r.Config.MaxConcurrency)
}

// The names of the targets kvxfer bench serve measures.
const (
	TargetDisaggregated = "disaggregated"
	TargetAggregated    = "aggregated"
)

func (r *Report) setupLine() string {
	c := r.Config
	w := c.Workload
	s := fmt.Sprintf("%s. Workload seed %d: %d requests, input %s, output %s (ignore_eos)", c.Setup, w.Seed, w.NumPrompts, w.Input.Spec, w.Output.Spec)
	if w.Turns > 1 {
		s += fmt.Sprintf(", %d turns per conversation", w.Turns)
	}
	if w.SystemPromptLen > 0 {
		s += fmt.Sprintf(", shared system prompt of %d tokens", w.SystemPromptLen)
	}
	if c.Burstiness != 1 {
		s += fmt.Sprintf(", burstiness %g", c.Burstiness)
	}
	if c.Warmup > 0 {
		s += fmt.Sprintf(", after %d unmeasured warm-up requests", c.Warmup)
	}
	switch {
	case c.Paired:
		s += ", paired: every conversation sent to each target in turn (the order rotating), one request at a time"
	case c.MaxConcurrency > 0:
		s += fmt.Sprintf(", at most %d in flight", c.MaxConcurrency)
	}
	if c.DurationS > 0 {
		s += fmt.Sprintf(", at most %g s per run", c.DurationS)
	}
	if c.SLO.Set() {
		var slo []string
		for _, o := range []struct {
			k string
			v float64
		}{{"ttft", c.SLO.TTFTMs}, {"tpot", c.SLO.TPOTMs}, {"e2el", c.SLO.E2ELMs}} {
			if o.v > 0 {
				slo = append(slo, fmt.Sprintf("%s ≤ %g ms", o.k, o.v))
			}
		}
		s += "; goodput SLO " + strings.Join(slo, ", ")
	}
	return s + "."
}

func concText(maxc int) string {
	if maxc <= 0 {
		return "–"
	}
	return strconv.Itoa(maxc)
}

func dist3(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f/%.1f/%.1f", d.P50, d.P90, d.P99)
}

func dist2(d Dist) string {
	if d.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f/%.2f", d.P50, d.P99)
}

func msCell(v float64, n int) string {
	if n == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", v)
}

func goodputCell(m *Metrics) string {
	if m.Goodput == nil {
		return "–"
	}
	return fmt.Sprintf("%.2f", *m.Goodput)
}

func kvBytesCell(m *Metrics) string {
	if m.KVBytes.N == 0 {
		return "–"
	}
	return bench.HumanBytes(int64(m.KVBytes.Mean))
}

func kvShareCell(m *Metrics) string {
	if m.KVShareTTFT.N == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f%%", 100*m.KVShareTTFT.P50)
}

// loadAverage returns the 1-minute load average of /proc/loadavg, nil
// where it cannot be read.
func loadAverage() *float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return nil
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return nil
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return nil
	}
	return &v
}
