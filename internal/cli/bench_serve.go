package cli

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/bench/perfreport"
	"github.com/kvxfer/kvxfer/bench/serving"
	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// benchServeLong is the help text of kvxfer bench serve.
const benchServeLong = `bench serve measures serving as users of vllm bench serve, genai-perf or aiperf do:
it sends a synthetic workload, generated from --seed (nothing is downloaded), as streamed
/v1/completions requests and reports TTFT, TPOT, inter-token latency (ITL) and end-to-end
latency (E2EL) as mean, p50, p90 and p99 in ms, request and output-token throughput,
goodput under the --goodput SLO, errors by kind, and from usage.kvxfer_timing the KV bytes
moved per request and the share of TTFT spent moving them.

Target: with --url a running router or worker; otherwise the cluster of -f (default: the
embedded one of kvxfer up), started as kvxfer up starts it, on free ports, and stopped at
the end. --compare-aggregated runs the same workload (same seed) against an aggregated
worker of the same model as well (started with the cluster, or --aggregated-url), each
rate's runs one after the other, and reports them side by side; with --paired instead
every conversation goes to both, one request at a time, alternating which goes first, so
that both see the same load (the fair way to measure the disaggregation overhead on a
shared machine).

Workload: --input-len and --output-len take N (or fixed:N), uniform:A-B, or chat (the shape
of a public chat dataset's prompt or reply lengths). Lengths are tokens, and the tokenizer
is byte-level: prompts are sent as token ids, BOS first. Answers are asked for with
max_tokens and ignore_eos; the report counts the tokens that came. With --turns N each
conversation has N turns after a --system-prompt-len system prompt shared by all, and turn
n resends the history with the earlier answers. Conversations start at --request-rate
(a Poisson process; --burstiness below 1 is burstier, as vllm's) or all at once (inf), with
at most --max-concurrency requests in flight, until --num-prompts requests were sent or
--duration has passed. --rates 1,2,4,8 sweeps rates, one run per rate and target.

Prefix reuse: each turn carries its conversation's id (--conversation-id says where), and
the report adds the prefix-hit rate (usage.prompt_tokens_details.cached_tokens over prompt
tokens), overall and per turn; the KV bytes moved per turn against the bytes of the turn's
new blocks, which the bench counts itself at --tokens-per-block (the prompt's blocks beyond
the full blocks of the previous turn's prompt and answer) times kv_block_bytes, and their
ratio; and TTFT by the path the router names in X-Kvxfer-Route (local or disaggregated).
Several -f compare clusters (reuse on and off, two router policies): each is started,
measured and stopped in turn, side by side in one report; --readme writes its summary
between the bench-reuse markers of a Markdown file.

The tables go to stdout; --json, --md and --png write the report (schema: --print-schema),
a Markdown document and a chart of TTFT p50/p99 and output throughput against the rate.
Exit status 1 when a request failed.`

// benchServeFlags are kvxfer bench serve's flags.
type benchServeFlags struct {
	url, aggURL, model                 string
	files                              []string
	tokensPerBlock                     int
	convField, readme                  string
	compare                            bool
	numPrompts, turns, systemLen, maxC int
	warmup                             int
	seed                               uint64
	inputLen, outputLen, rate          string
	rates, goodput                     []string
	burstiness                         float64
	duration, timeout                  time.Duration
	jsonPath, mdPath, pngPath          string
	printSchema, showLogs, paired      bool
}

func newBenchServeCmd(e env) *cobra.Command {
	var sf benchServeFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Measure serving under traffic: TTFT, TPOT, ITL, throughput, goodput (like vllm bench serve)",
		Long:  benchServeLong,
		Example: `  kvxfer bench serve --num-prompts 200 --request-rate 4 --input-len 128 --output-len 64
  kvxfer bench serve -f disagg_config.yaml --compare-aggregated --rates 1,2,4,8 --png sweep.png
  kvxfer bench serve --url http://localhost:8000 --input-len chat --output-len chat --goodput ttft:200 tpot:20`,
		Args: goodputArgs(&sf),
		RunE: func(cmd *cobra.Command, args []string) error {
			sf.goodput = append(sf.goodput, args...)
			return runBenchServe(cmd, e, &sf)
		},
	}
	f := cmd.Flags()
	f.StringVar(&sf.url, "url", "", "a running router or worker to measure (default: start the cluster of -f)")
	f.StringVar(&sf.aggURL, "aggregated-url", "", "with --url and --compare-aggregated: the aggregated worker to compare with")
	f.StringArrayVarP(&sf.files, "file", "f", nil, "cluster file (disagg_config.yaml) to start and measure; default: the embedded one of kvxfer up. Repeat it to compare clusters: each is started, measured and stopped in turn, and the report puts them side by side")
	f.IntVar(&sf.tokensPerBlock, "tokens-per-block", 0, fmt.Sprintf("block size of the bench's own count of each turn's new blocks (default: the cluster file's kv_cache_config.tokens_per_block; with --url %d)", config.DefaultTokensPerBlock))
	f.StringVar(&sf.convField, "conversation-id", serving.ConversationFieldTop, "where each turn carries its conversation's id: conversation_id (top level), disaggregated_params (disaggregated_params.conversation_id, where TensorRT-LLM's conversation router reads it; kvxfer's router reads both) or none")
	f.StringVar(&sf.readme, "readme", "", "rewrite the prefix-reuse summary of this Markdown file, between its bench-reuse marker lines (make bench-reuse)")
	f.StringVar(&sf.model, "model", "", "model: the preset the started workers serve (default "+serve.DefaultModel+") and the requests' model field (with --url, left out unless set)")
	f.BoolVar(&sf.compare, "compare-aggregated", false, "also run the same workload against an aggregated worker of the same model, side by side")
	f.BoolVar(&sf.paired, "paired", false, "with --compare-aggregated: send every conversation to both, one request at a time, alternating which goes first (a fair TTFT comparison on a machine whose load drifts)")
	f.IntVar(&sf.numPrompts, "num-prompts", 100, "requests to send per run (turns, over every conversation)")
	f.StringVar(&sf.inputLen, "input-len", "128", "prompt length in tokens (per turn): N, fixed:N, uniform:A-B or chat")
	f.StringVar(&sf.outputLen, "output-len", "32", "output length in tokens (max_tokens, with ignore_eos): N, fixed:N, uniform:A-B or chat")
	f.IntVar(&sf.warmup, "warmup", 2, "unmeasured requests sent one after the other before each run (they open the connections)")
	f.IntVar(&sf.turns, "turns", 1, "turns per conversation; turn n resends the history")
	f.IntVar(&sf.systemLen, "system-prompt-len", 0, "tokens of a system prompt every conversation starts with")
	f.Uint64Var(&sf.seed, "seed", 0, "seed of the workload and of the arrival times")
	f.StringVar(&sf.rate, "request-rate", "inf", "conversations (with --turns 1: requests) started per second, or inf for all at once")
	f.StringSliceVar(&sf.rates, "rates", nil, "a sweep of request rates, comma-separated (each a run); wins over --request-rate")
	f.Float64Var(&sf.burstiness, "burstiness", 1, "gamma shape of the gaps between starts: 1 is Poisson, below 1 burstier, above 1 more even")
	f.IntVar(&sf.maxC, "max-concurrency", 0, "requests in flight at most (0: no bound)")
	f.DurationVar(&sf.duration, "duration", 0, "send no request after this long in a run (0: no bound); those in flight finish")
	f.DurationVar(&sf.timeout, "timeout", serving.DefaultTimeout, "deadline of each request")
	f.StringArrayVar(&sf.goodput, "goodput", nil, `SLO of the goodput, key:ms for ttft, tpot, e2el ("--goodput ttft:200 tpot:20")`)
	f.StringVar(&sf.jsonPath, "json", "", "write the report as JSON to this file (schema: --print-schema)")
	f.StringVar(&sf.mdPath, "md", "", "write the report as Markdown to this file")
	f.StringVar(&sf.pngPath, "png", "", "write a chart of TTFT p50/p99 and output throughput against the rate to this PNG file")
	f.BoolVar(&sf.printSchema, "print-schema", false, "print the JSON Schema of the --json report and exit")
	f.BoolVar(&sf.showLogs, "show-logs", false, "show the logs of the workers bench serve starts")
	return cmd
}

// goodputArgs accepts, after --goodput, more key:ms words as vllm's
// --goodput does ("--goodput ttft:200 tpot:20"), and nothing else.
func goodputArgs(sf *benchServeFlags) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		for _, a := range args {
			k, _, ok := strings.Cut(a, ":")
			if !ok || !cmd.Flags().Changed("goodput") || (k != "ttft" && k != "tpot" && k != "e2el") {
				return fmt.Errorf("unexpected argument %q (SLO words key:ms follow --goodput; everything else is a flag)", a)
			}
		}
		return nil
	}
}

// options turns the flags into a sweep's base options, naming the flag of
// each problem, all at once.
func (sf *benchServeFlags) options() (serving.Options, []float64, error) {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	o := serving.Options{Model: sf.model, Burstiness: sf.burstiness, MaxConcurrency: sf.maxC, Warmup: sf.warmup, Duration: sf.duration, Timeout: sf.timeout}
	w := serving.Workload{Seed: sf.seed, NumPrompts: sf.numPrompts, Turns: sf.turns, SystemPromptLen: sf.systemLen}
	var err error
	if w.Input, err = serving.ParseLengths(sf.inputLen, false); err != nil {
		bad("--input-len: %v", err)
	}
	if w.Output, err = serving.ParseLengths(sf.outputLen, true); err != nil {
		bad("--output-len: %v", err)
	}
	if sf.numPrompts < 1 {
		bad("--num-prompts = %d: want at least 1", sf.numPrompts)
	}
	if sf.turns < 1 {
		bad("--turns = %d: want at least 1", sf.turns)
	}
	if sf.systemLen < 0 {
		bad("--system-prompt-len = %d: want 0 or more", sf.systemLen)
	}
	if !(sf.burstiness > 0) || math.IsInf(sf.burstiness, 0) {
		bad("--burstiness = %v: want a number above 0", sf.burstiness)
	}
	if sf.warmup < 0 {
		bad("--warmup = %d: want 0 or more", sf.warmup)
	}
	if sf.maxC < 0 {
		bad("--max-concurrency = %d: want 0 (no bound) or more", sf.maxC)
	}
	if sf.duration < 0 {
		bad("--duration = %v: want 0 (no bound) or more", sf.duration)
	}
	if sf.timeout <= 0 {
		bad("--timeout = %v: want more than 0", sf.timeout)
	}
	if o.SLO, err = serving.ParseSLO(sf.goodput); err != nil {
		bad("--goodput: %v", err)
	}
	if sf.aggURL != "" && (sf.url == "" || !sf.compare) {
		bad("--aggregated-url goes with --url and --compare-aggregated")
	}
	if sf.compare && sf.url != "" && sf.aggURL == "" {
		bad("--compare-aggregated with --url needs --aggregated-url (the aggregated worker to compare with)")
	}
	if sf.paired && (!sf.compare || len(sf.rates) > 0 || sf.rate != "inf" || sf.maxC > 1) {
		bad("--paired goes with --compare-aggregated and sends one request at a time: not with --rates, --request-rate or --max-concurrency above 1")
	}
	if sf.tokensPerBlock < 0 {
		bad("--tokens-per-block = %d: want 0 (the cluster file's) or more", sf.tokensPerBlock)
	}
	switch sf.convField {
	case serving.ConversationFieldTop, serving.ConversationFieldDisagg, serving.ConversationFieldNone:
	default:
		bad("--conversation-id %q: want %s, %s or %s", sf.convField, serving.ConversationFieldTop, serving.ConversationFieldDisagg, serving.ConversationFieldNone)
	}
	o.TokensPerBlock, o.ConversationField = sf.tokensPerBlock, sf.convField
	if sf.url != "" && len(sf.files) > 0 {
		bad("--url and -f exclude each other: measure a running server, or start the cluster of a file")
	}
	var rates []float64
	flag, words := "--request-rate", []string{sf.rate}
	if len(sf.rates) > 0 {
		flag, words = "--rates", sf.rates
	}
	for _, s := range words {
		r, err := parseRate(s)
		if err != nil {
			bad("%s %q: %v", flag, s, err)
			continue
		}
		rates = append(rates, r)
	}
	o.Workload = w
	return o, rates, errors.Join(errs...)
}

// parseRate parses a request rate: a positive number, or inf (0 in the
// report: all at once).
func parseRate(s string) (float64, error) {
	s = strings.TrimSpace(s)
	if s == "inf" {
		return 0, nil
	}
	r, err := strconv.ParseFloat(s, 64)
	if err != nil || !(r > 0) || math.IsInf(r, 0) {
		return 0, errors.New("want a number of requests per second above 0, or inf")
	}
	return r, nil
}

// runBenchServe runs kvxfer bench serve: it starts the cluster when there
// is no --url, runs the sweep and writes its table and reports.
func runBenchServe(cmd *cobra.Command, e env, sf *benchServeFlags) error {
	if sf.printSchema {
		_, err := io.WriteString(cmd.OutOrStdout(), serving.ReportSchema())
		return err
	}
	base, rates, err := sf.options()
	if err != nil {
		return err
	}
	s := serving.Sweep{Base: base, Rates: rates, Command: commandLine(cmd), Paired: sf.paired}
	s.Command = append([]string{"kvxfer", "bench", "serve"}, s.Command[2:]...)
	for i, w := range s.Command {
		if w == "--goodput" && i+1 < len(s.Command) { // a StringArray prints as [a,b]
			s.Command[i+1] = strings.Join(sf.goodput, " ")
		}
	}
	if i := slices.Index(s.Command, "--file"); i >= 0 && i+1 < len(s.Command) { // -f a -f b, first
		files := make([]string, 0, 2*len(sf.files))
		for _, f := range sf.files {
			files = append(files, "-f", f)
		}
		s.Command = slices.Concat(s.Command[:3], files, s.Command[3:i], s.Command[i+2:])
	}
	s.Progress = serving.NewProgress(cmd.ErrOrStderr(), isTerminal(cmd.ErrOrStderr()))
	var rep *serving.Report
	if sf.url != "" {
		s.Targets = []serving.Target{{Name: "url", URL: strings.TrimSuffix(sf.url, "/")}}
		s.Setup = "Measured " + sf.url
		if sf.compare {
			s.Targets = []serving.Target{{Name: serving.TargetDisaggregated, URL: strings.TrimSuffix(sf.url, "/")},
				{Name: serving.TargetAggregated, URL: strings.TrimSuffix(sf.aggURL, "/")}}
			s.Setup = fmt.Sprintf("Measured %s (disaggregated) and %s (aggregated)", sf.url, sf.aggURL)
		}
		if s.Base.TokensPerBlock == 0 {
			s.Base.TokensPerBlock = config.DefaultTokensPerBlock
		}
		if rep, err = serving.RunSweep(cmd.Context(), s); err != nil {
			return err
		}
	} else if rep, err = sweepClusters(cmd, e, sf, s); err != nil {
		return err
	}
	fmt.Fprintln(cmd.OutOrStdout())
	if err := rep.WriteTable(cmd.OutOrStdout()); err != nil {
		return err
	}
	rep.WriteErrors(cmd.ErrOrStderr())
	for _, out := range []struct {
		path  string
		write func(io.Writer) error
	}{{sf.jsonPath, rep.WriteJSON}, {sf.mdPath, rep.WriteMarkdown}, {sf.pngPath, rep.WritePNG}} {
		if out.path == "" {
			continue
		}
		if err := writeFile(out.path, out.write); err != nil {
			return err
		}
	}
	if sf.readme != "" {
		if err := spliceReuseSummary(sf.readme, rep); err != nil {
			return err
		}
	}
	if cmd.Context().Err() != nil {
		return cmd.Context().Err()
	}
	if rep.FailedRuns() {
		return exitError{1}
	}
	return nil
}

// sweepClusters runs s against the cluster of each -f (the default one
// without -f), one after the other: it starts the cluster, runs the
// sweep, stops it, and merges the reports, side by side.
func sweepClusters(cmd *cobra.Command, e env, sf *benchServeFlags, s serving.Sweep) (*serving.Report, error) {
	files := sf.files
	if len(files) == 0 {
		files = []string{""}
	}
	if s.Base.Model == "" {
		s.Base.Model = serve.DefaultModel
	}
	var reps []*serving.Report
	for _, file := range files {
		if err := cmd.Context().Err(); err != nil {
			return nil, err
		}
		l, setup, tpb, err := startBenchCluster(cmd, e, sf, file)
		if err != nil {
			return nil, err
		}
		fs := s
		fs.Base.Client = l.Client()
		if fs.Base.TokensPerBlock == 0 {
			fs.Base.TokensPerBlock = tpb
		}
		cluster := ""
		if len(files) > 1 {
			cluster = file
		}
		fs.Targets = []serving.Target{{Name: serving.TargetDisaggregated, URL: l.RouterURL, Cluster: cluster}}
		if sf.compare {
			fs.Targets = append(fs.Targets, serving.Target{Name: serving.TargetAggregated, URL: l.AggregatedURL, Cluster: cluster})
		}
		fs.Setup = setup
		rep, err := serving.RunSweep(cmd.Context(), fs)
		l.Stop()
		if err != nil {
			return nil, err
		}
		if len(reps) > 0 && rep.Config.TokensPerBlock != reps[0].Config.TokensPerBlock {
			return nil, fmt.Errorf("-f %s: tokens_per_block %d, but %d in -f %s: the clusters compared must count blocks alike (or give --tokens-per-block)",
				file, rep.Config.TokensPerBlock, reps[0].Config.TokensPerBlock, files[0])
		}
		reps = append(reps, rep)
	}
	return serving.Merge(reps...), nil
}

// spliceReuseSummary rewrites the reuse summary of the Markdown file path
// between its bench-reuse markers.
func spliceReuseSummary(path string, rep *serving.Report) error {
	old, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("--readme: %w", err)
	}
	var section strings.Builder
	if err := rep.WriteReuseSummary(&section); err != nil {
		return err
	}
	out, err := perfreport.SpliceSection(old, serving.ReuseBeginMarker, serving.ReuseEndMarker, section.String())
	if err != nil {
		return fmt.Errorf("--readme %s: %w", path, err)
	}
	return os.WriteFile(path, out, 0o644)
}

// startBenchCluster starts the cluster of file (the default one for "")
// as kvxfer up does, on free ports, with an aggregated worker for
// --compare-aggregated, and says what it started and its generation
// workers' tokens per block.
func startBenchCluster(cmd *cobra.Command, e env, sf *benchServeFlags, file string) (*launch.Launched, string, int, error) {
	log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	cl, err := loadCluster(file, e, log)
	if err != nil {
		return nil, "", 0, err
	}
	cl.Port = -1 // any free port: a benchmark must not clash with a running cluster
	secret, err := loadSecret(&cl.Security, config.LoadEnv(e.lookup, e.environ), log)
	if err != nil {
		return nil, "", 0, err
	}
	var out io.Writer
	if sf.showLogs {
		out = cmd.ErrOrStderr()
	}
	model := sf.model
	if model == "" {
		model = serve.DefaultModel
	}
	fmt.Fprintln(cmd.ErrOrStderr(), "bench serve: starting the cluster", file)
	l, err := launch.Start(cmd.Context(), launch.Options{Cluster: cl, Model: model, Aggregated: sf.compare, Output: out,
		Logger: log, Secret: secret, TLS: (&tlsFlags{}).or(cl.Security.TLS)})
	if err != nil {
		return nil, "", 0, err
	}
	name := file
	if name == "" {
		name = "the default cluster of kvxfer up"
	}
	backend := "DEFAULT"
	if ct := cl.Context.CacheTransceiver; ct != nil && ct.Backend != "" {
		backend = string(ct.Backend)
	}
	setup := fmt.Sprintf("Started %s: model %s, %d context worker(s) TP%d PP%d, %d generation worker(s) TP%d PP%d, backend %s",
		name, model, len(l.ContextURLs), max(cl.Context.TensorParallelSize, 1), max(cl.Context.PipelineParallelSize, 1),
		len(l.GenerationURL), max(cl.Generation.TensorParallelSize, 1), max(cl.Generation.PipelineParallelSize, 1), backend)
	setup += fmt.Sprintf(", routers %s (context) and %s (generation)", cmp.Or(cl.Context.Router, config.RouterRoundRobin),
		cmp.Or(cl.Generation.Router, config.RouterRoundRobin))
	if cd := cl.ConditionalDisagg; cd != nil {
		setup += fmt.Sprintf(", conditional disaggregation at max_local_prefill_length %d", cd.MaxLocalPrefillLength)
	}
	if sf.compare {
		setup += ", and an aggregated worker (TP1)"
	}
	return l, setup, cmp.Or(cl.Generation.KVCache.TokensPerBlock, config.DefaultTokensPerBlock), nil
}
