package bench

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/buildinfo"
	"github.com/kvxfer/kvxfer/kvcache"
)

// ReportVersion is the version of the report's JSON form; it changes when a
// field changes meaning or goes away (not when one is added).
//
// Version 2: a run's gbps and transfers_per_s are its best round's (see
// Sweep.Rounds), no longer bytes over measured_s, which are sums over the
// rounds; runs and baselines have rounds.
const ReportVersion = 2

// Sweep is a set of benchmark runs: every combination of its lists, in the
// order backend, dtype, concurrency, ISL, TLS, each run with its own context
// process and warm-up, one after the other so that memory stays bounded by
// the largest run. With Baseline the machine's limits are measured first,
// in the same process. With Rounds above 1 all of that is done Rounds
// times, in turns (see Rounds).
type Sweep struct {
	// Base holds the settings every run shares. Its Backend, ISL,
	// Concurrency and DType are used where the lists below are empty.
	Base        Config
	Backends    []string
	ISLs        []int
	Concurrency []int
	DTypes      []string
	// TLS lists the TLS modes each run is made in (Config.TLS); empty
	// means Base.TLS alone. {false, true} puts every run with mutual TLS
	// next to the same run without, and with any run in TLS the sweep also
	// measures the cipher's limit (openssl speed), with or without
	// Baseline.
	TLS []bool
	// Baseline measures the machine's limits (see Baseline) and every
	// run's ratio to those that apply to its backend.
	Baseline bool
	// BaselineBytes is what each baseline moves; 0 means the largest
	// request of the sweep, clamped to [64 MiB, 1 GiB].
	BaselineBytes int64
	// Rounds is how many times the sweep measures everything, in turns:
	// round k measures every baseline once and then makes every run once
	// (each with its own context process and warm-up), so that a
	// baseline's and a run's figures are taken at the same moments of a
	// noisy machine. A baseline's figure and a run's are then each the
	// best of their rounds (Baseline.Rounds, Result.Rounds), and each ratio
	// is also given as the median of the per-round ratios
	// (Result.MedianRoundRatios). Every round tries every setting of a
	// baseline (Baseline.Variants) and takes its best.
	// 0 means 1: one measurement of each, as before rounds existed.
	Rounds int
	// Command is the command line, recorded in the report.
	Command []string
	// Progress is told about every step; nil discards.
	Progress func(Event)

	lookPath func(string) (string, error) // exec.LookPath; tests replace it
	// measureBaselines measures round k's baselines and run makes one
	// round of a run; nil means the real ones (tests replace them).
	measureBaselines func(ctx context.Context, k int) []Baseline
	run              func(ctx context.Context, c Config) (*Result, error)
}

// Report is the outcome of a sweep; its JSON form (see ReportSchema) is the
// report of `kvxfer bench --json`.
type Report struct {
	Version   int            `json:"report_version"`
	Command   []string       `json:"command"`
	Started   time.Time      `json:"started"`
	DurationS float64        `json:"duration_s"`
	Build     buildinfo.Info `json:"build"`
	Machine   Machine        `json:"machine"`
	Config    SweepConfig    `json:"config"`
	Baselines []Baseline     `json:"baselines"`
	Runs      []*Result      `json:"runs"`
	// Errors is the sum of the runs' errors.
	Errors int `json:"errors"`
}

// SweepConfig is the effective configuration of a sweep: every default
// filled in.
type SweepConfig struct {
	Model             string            `json:"model"`
	Backends          []string          `json:"backends"`
	ISLs              []int             `json:"isls"`
	Concurrency       []int             `json:"concurrency"`
	DTypes            []string          `json:"dtypes"`
	TLS               []bool            `json:"tls,omitempty"`
	Requests          int               `json:"requests"`
	Warmup            int               `json:"warmup"`
	Ctx               Par               `json:"ctx"`
	Gen               Par               `json:"gen"`
	MLA               bool              `json:"mla"`
	TokensPerBlock    int               `json:"tokens_per_block"`
	MaxTokensInBuffer int               `json:"max_tokens_in_buffer"`
	Verify            bool              `json:"verify"`
	Baseline          bool              `json:"baseline"`
	BaselineBytes     int64             `json:"baseline_bytes"`
	Rounds            int               `json:"rounds,omitempty"`
	Env               map[string]string `json:"env"` // the TRTLLM_* and UCX_* variables that were set
}

// Machine describes where the sweep ran.
type Machine struct {
	CPUs        int    `json:"cpus"` // runtime.NumCPU: the CPUs this process may use
	CPUModel    string `json:"cpu_model,omitempty"`
	MemoryBytes int64  `json:"memory_bytes,omitempty"`
	GOOS        string `json:"goos"`
	GOARCH      string `json:"goarch"`
	GoVersion   string `json:"go_version"`
}

// Failed reports whether any run failed: the exit status of kvxfer bench is
// 1 then.
func (r *Report) Failed() bool {
	for _, run := range r.Runs {
		if !run.OK() {
			return true
		}
	}
	return false
}

// fill applies the defaults to s and returns the effective configuration,
// or every problem with it at once.
func (s *Sweep) fill() (SweepConfig, error) {
	base := &s.Base
	s.listsFromBase()
	base.defaults()
	if s.lookPath == nil {
		s.lookPath = exec.LookPath
	}
	if s.Progress == nil {
		s.Progress = func(Event) {}
	}
	if s.run == nil {
		s.run = Run
	}
	if s.Rounds < 0 {
		return SweepConfig{}, fmt.Errorf("bench: --rounds %d: want at least 1", s.Rounds)
	}
	s.Rounds = max(s.Rounds, 1)
	if err := s.normalizeLists(); err != nil {
		return SweepConfig{}, err
	}
	largest, err := s.largestRequest()
	if err != nil {
		return SweepConfig{}, err
	}
	if s.BaselineBytes <= 0 {
		s.BaselineBytes = min(max(largest, 64<<20), 1<<30)
	}
	m, _ := LookupModel(base.Model)
	return SweepConfig{Model: m.Name, Backends: s.Backends, ISLs: s.ISLs, Concurrency: s.Concurrency, DTypes: s.DTypes, TLS: s.TLS,
		Requests: base.Requests, Warmup: base.Warmup, Ctx: Par{base.CtxTP, base.CtxPP}, Gen: Par{base.GenTP, base.GenPP},
		MLA: base.MLA || m.MLA, TokensPerBlock: base.TokensPerBlock, MaxTokensInBuffer: base.MaxTokensInBuffer,
		Verify: base.Verify, Baseline: s.Baseline, BaselineBytes: s.BaselineBytes, Rounds: s.Rounds, Env: envVars(base.Env)}, nil
}

// listsFromBase makes an empty list the one value of Base (before Base's
// own defaults, which normalizeLists applies to each entry).
func (s *Sweep) listsFromBase() {
	base := &s.Base
	if len(s.Backends) == 0 {
		s.Backends = []string{base.Backend}
	}
	if len(s.ISLs) == 0 {
		s.ISLs = []int{base.ISL}
	}
	if len(s.Concurrency) == 0 {
		s.Concurrency = []int{base.Concurrency}
	}
	if len(s.DTypes) == 0 {
		s.DTypes = []string{base.DType}
	}
	if len(s.TLS) == 0 {
		s.TLS = []bool{base.TLS}
	}
}

// normalizeLists gives every unset entry of the lists its default and
// spells every backend and dtype one way; it reports every unknown name.
func (s *Sweep) normalizeLists() error {
	d := DefaultConfig()
	var errs []error
	for i, b := range s.Backends {
		if b == "" {
			b = d.Backend
		}
		n, err := backendName(b)
		if err != nil {
			errs = append(errs, fmt.Errorf("--backend: %w", err))
		}
		s.Backends[i] = n
	}
	for i, isl := range s.ISLs {
		if isl <= 0 {
			s.ISLs[i] = d.ISL
		}
	}
	for i, c := range s.Concurrency {
		if c <= 0 {
			s.Concurrency[i] = d.Concurrency
		}
	}
	for i, dt := range s.DTypes {
		if dt == "" {
			dt = d.DType
		}
		parsed, err := kvcache.ParseDType(dt)
		if err != nil {
			errs = append(errs, fmt.Errorf("--dtype: %w", err))
			continue
		}
		s.DTypes[i] = parsed.String()
	}
	if _, err := LookupModel(s.Base.Model); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// largestRequest checks every shape of the sweep before anything runs and
// returns the bytes of its largest request.
func (s *Sweep) largestRequest() (int64, error) {
	var largest int64
	var errs []error
	for _, d := range s.DTypes {
		c := s.Base
		c.DType = d
		_, cs, _, err := c.states()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		largest = max(largest, cs.Shape.BytesPerToken()*int64(slices.Max(s.ISLs)))
	}
	return largest, errors.Join(errs...)
}

func envVars(e config.Env) map[string]string {
	out := map[string]string{}
	for _, k := range slices.Sorted(maps.Keys(e.Raw)) {
		out[k] = e.Raw[k]
	}
	return out
}

// RunSweep runs the sweep. The error is for a sweep that cannot start (an
// unknown model, backend name or dtype) or was cancelled; a run that fails
// (a backend this binary lacks, a failed transfer) is a row of the report
// with its error, and the other runs still run. A run that fails in one
// round is not made again in later rounds, and its row keeps the error.
func RunSweep(ctx context.Context, s Sweep) (*Report, error) {
	started := time.Now()
	cfg, err := s.fill()
	if err != nil {
		return nil, err
	}
	rep := &Report{Version: ReportVersion, Command: s.Command, Started: started.UTC().Truncate(time.Second),
		Build: buildinfo.Read(), Machine: readMachine(), Config: cfg, Baselines: []Baseline{}, Runs: []*Result{}}
	if rep.Command == nil {
		rep.Command = []string{}
	}
	if s.measureBaselines == nil {
		s.measureBaselines = s.baselines()
	}
	runs := s.runs()
	rounds := make([][]*Result, len(runs)) // rounds[i][k]: run i's round k
	var baselines [][]Baseline             // baselines[k]: round k's
	for k := range s.Rounds {
		if err := ctx.Err(); err != nil {
			break
		}
		bs := s.measureBaselines(ctx, k)
		baselines = append(baselines, bs)
		if bs != nil {
			freeMemory()
		}
		for i, rc := range runs {
			if err := ctx.Err(); err != nil {
				break
			}
			if n := len(rounds[i]); n > 0 && !rounds[i][n-1].OK() {
				continue // failed: its row keeps the error
			}
			res := s.runRound(ctx, rc, i, len(runs), k)
			rounds[i] = append(rounds[i], res)
			// The next run allocates its own pools: give this one's back.
			freeMemory()
		}
	}
	rep.Baselines = mergeBaselines(baselines)
	for _, rs := range rounds {
		if len(rs) == 0 {
			continue // cancelled before it ran
		}
		res := mergeRuns(rs, s.Rounds)
		res.Ratios = ratios(res, rep.Baselines)
		res.MedianRoundRatios = roundRatios(res, rep.Baselines)
		rep.Runs = append(rep.Runs, res)
	}
	rep.finish(started)
	return rep, ctx.Err()
}

// baselines returns what measures round k's baselines of s: nothing
// without Baseline or a run over TLS.
func (s *Sweep) baselines() func(context.Context, int) []Baseline {
	tlsOn := slices.Contains(s.TLS, true)
	if !s.Baseline && !tlsOn {
		return func(context.Context, int) []Baseline { return nil }
	}
	br := &baselineRunner{cfg: s.Base, bytes: s.BaselineBytes, lookPath: s.lookPath, timeout: 2 * time.Minute,
		report: func(b Baseline, k int) {
			e := Event{Phase: PhaseBaseline, Baseline: &b}
			if s.Rounds > 1 {
				e.Round, e.Rounds = k+1, s.Rounds
			}
			s.Progress(e)
		}, tls: tlsOn,
		ucx: slices.Contains(s.Backends, config.BackendUCX.Lower()), mpi: slices.ContainsFunc(s.Backends, isMPI), mpiBTL: s.Base.MPIBTL}
	ms := br.measures(s.Baseline)
	return func(ctx context.Context, k int) []Baseline { return br.round(ctx, ms, k) }
}

// runs are the configurations of every run of s, in order.
func (s *Sweep) runs() []Config {
	var runs []Config
	for _, b := range s.Backends {
		for _, d := range s.DTypes {
			for _, c := range s.Concurrency {
				for _, isl := range s.ISLs {
					for _, tl := range s.TLS {
						rc := s.Base
						rc.Backend, rc.DType, rc.Concurrency, rc.ISL, rc.TLS = b, d, c, isl, tl
						runs = append(runs, rc)
					}
				}
			}
		}
	}
	return runs
}

// runRound makes round k of run i of n (configuration rc), telling
// Progress, and returns its row: a failed set-up is a row with its error.
func (s *Sweep) runRound(ctx context.Context, rc Config, i, n, k int) *Result {
	label := rc.newResult().Label()
	ev := Event{Run: i + 1, Runs: n, Label: label}
	if s.Rounds > 1 {
		ev.Round, ev.Rounds = k+1, s.Rounds
	}
	rc.Progress = func(e Event) {
		e.Run, e.Runs, e.Label, e.Round, e.Rounds = ev.Run, ev.Runs, ev.Label, ev.Round, ev.Rounds
		s.Progress(e)
	}
	start := ev
	start.Phase, start.Total = PhaseStart, rc.Warmup+rc.Requests
	s.Progress(start)
	res, err := s.run(ctx, rc)
	if res == nil {
		res = rc.newResult()
		if rc.Verify {
			res.Verification = VerifyNotRun
		}
	}
	if err != nil {
		res.fail(err)
	}
	done := ev
	done.Phase, done.Result = PhaseDone, res
	s.Progress(done)
	return res
}

func (r *Report) finish(started time.Time) {
	r.DurationS = time.Since(started).Seconds()
	r.Errors = 0
	for _, run := range r.Runs {
		r.Errors += run.Errors
	}
}

func freeMemory() {
	runtime.GC()
	debug.FreeOSMemory()
}

func readMachine() Machine {
	m := Machine{CPUs: runtime.NumCPU(), GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, GoVersion: runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for line := range strings.Lines(string(b)) {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	m.MemoryBytes, _ = meminfo("MemTotal")
	return m
}

// memAvailable is the memory the kernel says can be allocated without
// swapping, where it says so.
func memAvailable() (int64, bool) { return meminfo("MemAvailable") }

func meminfo(key string) (int64, bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(line, ":")
		if !ok || k != key {
			continue
		}
		var kb int64
		if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
			return 0, false
		}
		return kb << 10, true
	}
	return 0, false
}
