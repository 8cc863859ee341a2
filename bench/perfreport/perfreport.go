package perfreport

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"strconv"
	"strings"
)

// ErrInput is wrapped by every error about a report or benchmark output
// that cannot be read or lacks a figure a target needs.
var ErrInput = errors.New("perfreport: bad input")

// Report is the part of a kvxfer bench JSON report (bench/report.schema.json)
// that the targets read.
type Report struct {
	Version   int        `json:"report_version"`
	Args      []string   `json:"command"`
	Started   string     `json:"started"`
	Build     Build      `json:"build"`
	Config    Config     `json:"config"`
	Baselines []Baseline `json:"baselines"`
	Runs      []Run      `json:"runs"`
}

// Config is the part of the report's configuration the summary names.
type Config struct {
	// Rounds is how many rounds the bench measured in (kvxfer bench
	// --rounds); 0 in a report made before rounds existed, which had one.
	Rounds int `json:"rounds"`
}

// rounds is how many rounds r measured in.
func (r *Report) rounds() int { return max(r.Config.Rounds, 1) }

// Command returns the command line of the report, as a shell would take
// it, with env (NAME=value words, may be empty) in front: the bench does
// not record the environment it ran in.
func (r *Report) Command(env string) string {
	var b strings.Builder
	if env != "" {
		b.WriteString(env + " ")
	}
	for i, a := range r.Args {
		if i > 0 {
			b.WriteByte(' ')
		}
		if a == "" || strings.ContainsAny(a, " \t'\"$`\\|&;<>()*?[]#~") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		b.WriteString(a)
	}
	return b.String()
}

// baseline returns the baseline of r named name.
func (r *Report) baseline(name string) (Baseline, bool) {
	for _, b := range r.Baselines {
		if b.Name == name {
			return b, true
		}
	}
	return Baseline{}, false
}

// Build is the report's build section.
type Build struct {
	Revision string `json:"revision"`
}

// Baseline is one machine limit measured in the run.
type Baseline struct {
	Name        string  `json:"name"`
	Description string  `json:"description"`
	GBps        float64 `json:"gbps"`
	Best        string  `json:"best"`
	Rounds      []Round `json:"rounds"`
}

// Round is one round's figure of a run or a baseline.
type Round struct {
	GBps float64 `json:"gbps"`
}

// Run is one measured run of a report.
type Run struct {
	BackendRequested string  `json:"backend_requested"`
	Backend          string  `json:"backend"`
	ISL              int     `json:"isl"`
	Concurrency      int     `json:"concurrency"`
	Ctx              TPPP    `json:"ctx"`
	Gen              TPPP    `json:"gen"`
	GBps             float64 `json:"gbps"`
	TransfersPerS    float64 `json:"transfers_per_s"`
	P50Ms            float64 `json:"p50_ms"`
	Errors           int     `json:"errors"`
	Ratios           []Ratio `json:"ratios"` // the best round over the baseline's best round
	// MedianRoundRatios are, per baseline, the median of the per-round
	// ratios (round k's run over round k's baseline): the figure the
	// targets read.
	MedianRoundRatios []Ratio `json:"median_round_ratios"`
	Rounds            []Round `json:"rounds"`
}

// TPPP is one side's parallel layout.
type TPPP struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
}

// Ratio is a run's throughput over one baseline's.
type Ratio struct {
	Baseline string  `json:"baseline"`
	Ratio    float64 `json:"ratio"`
}

// ReadReport reads one JSON report from path.
func ReadReport(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInput, err)
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrInput, path, err)
	}
	if len(r.Args) == 0 || len(r.Runs) == 0 {
		return nil, fmt.Errorf("%w: %s: not a kvxfer bench report (no command or no runs)", ErrInput, path)
	}
	return &r, nil
}

// LayoutCase is one pack or unpack benchmark of package layout, as a
// multiple of a plain copy of the same bytes over the same memory, timed
// alternately with it (the median of the paired ratios).
type LayoutCase struct {
	Name   string
	XCopy  float64
	Source string // the output line it was read from
}

var benchLine = regexp.MustCompile(`^(Benchmark(?:Pack|Unpack)/\S+?)(?:-\d+)?\s`)

// ReadLayout reads the x-copy metric of every Pack and Unpack benchmark
// from go test -bench output (the copy sub-benchmarks, which have none,
// are skipped). With -count above 1 a case appears several times; each is
// kept.
func ReadLayout(r io.Reader) ([]LayoutCase, error) {
	var out []LayoutCase
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		m := benchLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		f := strings.Fields(line)
		for i := 1; i < len(f); i++ {
			if f[i] != "x-copy" {
				continue
			}
			v, err := strconv.ParseFloat(f[i-1], 64)
			if err != nil {
				return nil, fmt.Errorf("%w: layout benchmark %s: x-copy %q: %w", ErrInput, m[1], f[i-1], err)
			}
			out = append(out, LayoutCase{Name: m[1], XCopy: v, Source: line})
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: layout benchmarks: %w", ErrInput, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: layout benchmarks: no Pack/Unpack line with an x-copy metric", ErrInput)
	}
	return out, nil
}

// Inputs are the reports of one make bench-report, by what they measured.
type Inputs struct {
	Main   *Report      // llama-3.1-8b, 4096 tokens, identical layouts: tcp, shm, ucx with the baselines
	TP2    *Report      // the same with context TP2 → generation TP1, tcp
	UCXTCP *Report      // ucx with UCX_TLS=tcp (its ucx_perftest baseline with the same)
	Small  *Report      // tiny model, 32 tokens (one 64 KiB block): tcp and shm, concurrency 1 and 8
	Layout []LayoutCase // go test -bench 'Pack|Unpack' ./layout/
	// LayoutCommand is the command that produced Layout.
	LayoutCommand string
}

// Result is one target, evaluated.
type Result struct {
	Target   string // what is required, in words
	Measured string // the figure, in words
	Met      bool
	Command  string // the command whose output holds the figure
}

// find returns the first run of r that matches.
func find(r *Report, match func(Run) bool) (Run, bool) {
	if r == nil {
		return Run{}, false
	}
	for _, run := range r.Runs {
		if match(run) {
			return run, true
		}
	}
	return Run{}, false
}

func ratio(run Run, baseline string) (float64, bool) { return find1(run.Ratios, baseline) }

func find1(qs []Ratio, baseline string) (float64, bool) {
	for _, q := range qs {
		if q.Baseline == baseline {
			return q.Ratio, true
		}
	}
	return 0, false
}

// targetRatio is the ratio every target reads: the median of the run's
// per-round ratios to baseline. A report from before rounds (version 1)
// measured one round, whose one ratio is that median.
func targetRatio(rep *Report, run Run, baseline string) (float64, bool) {
	if rep.Version < 2 {
		return ratio(run, baseline)
	}
	return find1(run.MedianRoundRatios, baseline)
}

func backend(name string) func(Run) bool {
	return func(r Run) bool { return r.BackendRequested == name && r.Errors == 0 }
}

// The prompt lengths the targets are stated for.
const (
	bigISL   = 4096 // llama-3.1-8b: 512 MiB a request
	smallISL = 32   // tiny: one 64 KiB block
)

// Evaluate checks every target on ins. A target whose report or figure is
// missing is reported as not met, saying what is missing, never skipped.
// A ratio target reads, for every target alike, the median of the run's
// per-round ratios (targetRatio): each of those divides two figures
// measured within a minute of each other, where the best round over the
// best round may divide figures of different minutes.
func Evaluate(ins Inputs) []Result {
	ucx := []string{"ucx_perftest", "ucx_c"} // UCX's tool, and UCX on written huge pages
	out := []Result{
		ratioTarget(ins.Main, "", "tcp, identical layouts", "tcp", []string{"iperf3"}, 0.9, nil),
		ratioTarget(ins.Main, "", "tcp, identical layouts", "tcp", []string{"iperf3_multi"}, 0.9, nil),
		ratioTarget(ins.TP2, "", "tcp, context TP2 → generation TP1", "tcp", []string{"iperf3"}, 0.85, func(r Run) bool { return r.Ctx.TP == 2 && r.Gen.TP == 1 }),
		ratioTarget(ins.UCXTCP, "UCX_TLS=tcp", "ucx, UCX_TLS=tcp", "ucx", ucx, 0.9, nil),
		ratioTarget(ins.Main, "", "ucx, UCX's own choice of transports", "ucx", ucx, 0.95, nil),
		ratioTarget(ins.Main, "", "shm", "shm", []string{"copy"}, 0.9, nil),
	}
	for _, be := range []string{"tcp", "shm"} {
		out = append(out, smallTargets(ins.Small, be)...)
	}
	return append(out, layoutTarget(ins))
}

// ratioTarget checks that the run of backend be in rep (and extra, when
// not nil) reaches least times the highest of baselines measured in rep (the
// lowest of its ratios to them); env, when set, is the environment the
// baselines must have run in.
func ratioTarget(rep *Report, env, label, be string, baselines []string, least float64, extra func(Run) bool) Result {
	what := baselines[0]
	if len(baselines) > 1 {
		what = "the best of " + strings.Join(baselines, ", ")
	}
	res := Result{Target: fmt.Sprintf("%s ≥ %.2f× %s", label, least, what)}
	if rep != nil {
		res.Command = rep.Command(env)
	}
	if rep != nil && env != "" {
		// The baselines must have run in the same environment: the
		// bench records UCX_TLS in the UCX baselines' descriptions.
		for _, name := range baselines {
			if bl, ok := rep.baseline(name); ok && !strings.Contains(bl.Description, env) {
				res.Measured = fmt.Sprintf("the report's %s did not run with %s (%q)", name, env, bl.Description)
				return res
			}
		}
	}
	run, ok := find(rep, func(r Run) bool { return backend(be)(r) && r.ISL == bigISL && (extra == nil || extra(r)) })
	if !ok {
		res.Measured = fmt.Sprintf("no error-free %s run of %d tokens in the report", be, bigISL)
		return res
	}
	q, by := math.Inf(1), ""
	for _, name := range baselines {
		if r, ok := targetRatio(rep, run, name); ok && r < q {
			q, by = r, name
		}
	}
	if by == "" {
		res.Measured = "no " + strings.Join(baselines, " or ") + " baseline in the report"
		for _, name := range baselines {
			if _, ok := ratio(run, name); ok {
				res.Measured = "no median of the per-round ratios to " + strings.Join(baselines, " or ") + " in the report"
			}
		}
		return res
	}
	res.Measured = fmt.Sprintf("%.2f GB/s = %.2f×", run.GBps, q)
	if len(baselines) > 1 {
		res.Measured += " " + by
	}
	if n := rep.rounds(); n > 1 {
		best, _ := ratio(run, by)
		res.Measured += fmt.Sprintf(" (median of %d rounds' ratios; best round over best round %.2f×)", n, best)
	}
	res.Met = q >= least
	return res
}

// smallTargets checks the small-transfer targets of backend be in rep:
// p50 one at a time, and transfers per second 8 at a time.
func smallTargets(rep *Report, be string) []Result {
	res := Result{Target: be + ", one 64 KiB block, one at a time: p50 ≤ 0.100 ms"}
	if rep != nil {
		res.Command = rep.Command("")
	}
	if run, ok := find(rep, func(r Run) bool { return backend(be)(r) && r.ISL == smallISL && r.Concurrency == 1 }); ok {
		res.Measured, res.Met = fmt.Sprintf("p50 %.3f ms", run.P50Ms), run.P50Ms <= 0.1
	} else {
		res.Measured = "no error-free " + be + " run at concurrency 1 in the report"
	}
	conc := Result{Target: be + ", one 64 KiB block, 8 at a time: ≥ 10,000 transfers/s", Command: res.Command}
	if run, ok := find(rep, func(r Run) bool { return backend(be)(r) && r.ISL == smallISL && r.Concurrency == 8 }); ok {
		conc.Measured, conc.Met = fmt.Sprintf("%.0f transfers/s", run.TransfersPerS), run.TransfersPerS >= 10000
	} else {
		conc.Measured = "no error-free " + be + " run at concurrency 8 in the report"
	}
	return []Result{res, conc}
}

// layoutTarget checks that every layout pairing benchmarked packs and
// unpacks at 0.8× copy at least.
func layoutTarget(ins Inputs) Result {
	res := Result{Target: "layout Pack/Unpack, every pairing: ≥ 0.80× copy", Command: ins.LayoutCommand}
	if len(ins.Layout) == 0 {
		res.Measured = "no layout benchmark output"
	} else {
		worst := ins.Layout[0]
		for _, c := range ins.Layout[1:] {
			if c.XCopy < worst.XCopy {
				worst = c
			}
		}
		res.Measured = fmt.Sprintf("lowest %.2f× (%s)", worst.XCopy, worst.Name)
		res.Met = worst.XCopy >= 0.8 && !math.IsNaN(worst.XCopy)
	}
	return res
}
