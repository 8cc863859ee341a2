package cli

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/config"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// benchLong is the help text of kvxfer bench.
const benchLong = `bench starts a context instance as a child process, has it prefill requests with
known contents, pulls them into a generation instance in this process over the chosen
backend, and reports bytes, GB/s (1e9 bytes/s over the measured phase, after a warm-up),
transfers/s, p50/p99 latency per request and the backend that carried the data.

--backend, --isl, --concurrency and --dtype take comma-separated lists: every
combination is one run, with its own context process and warm-up, one after the other.
A backend this binary lacks (ucx without -tags ucx) is a failed run in the report, not
a stop. With --verify every generation byte is checked against the naive reference
sharding (requests over 1 GiB are reported as "skipped (too large for the naive
reference)"). With --baseline the machine's own limits are measured in the same run,
each at its best (memory copy on one and two threads, Go's copy or C's memcpy; one raw
TCP stream over loopback; iperf3 with one stream and with as many as the tcp backend
opens, best of write lengths 128K, 1M and 4M, each run twice; with a ucx run, ucx_perftest as a user runs
it, best of two message sizes, and a C UCP program on written, huge-page memory, built with
cc at bench time, best of message sizes and page sizes; each when installed), the JSON recording every
setting tried, and every run is compared with those that apply to its backend. With --tls
every run is made twice, without and with mutual TLS (TLS 1.3 on the control and tcp data
connections, certificates made for the run), and the cipher's limit on one core (openssl
speed -evp aes-128-gcm, 16 KiB blocks) is measured in the same run and compared with the
runs that tcp carried over TLS.

With --rounds N (N > 1) the sweep measures everything N times, in turns: round k
measures every baseline once (trying every setting of each, in every round) and then
makes every run once, each with its own context
process and warm-up. Every baseline's and run's figure is then the best of its N rounds
(the JSON records each round), a ratio is the best over the best, and the median of the
per-round ratios (round k's run over round k's baseline, measured within a minute of each
other) is reported next to it; p50 and p99 are of every round's requests pooled. A run
that fails in one round fails, and is not made again.

With --process-per-rank every rank of both instances runs as its own OS process (as
engines run one process per GPU rank), the ranks of an instance agreeing over a
coordinated group (rank 0's process coordinating); the cost of that agreement per
request is printed after the table and recorded in the report.

With --backend mpi (a binary built with -tags mpi, and OpenMPI's mpirun) the two
processes are the two ranks of one MPI world that bench starts with mpirun -np 2
(rank 0 the generation side, rank 1 the context side), pinned to the OpenMPI
component --mpi-btl names (vader, shared memory, or tcp), which the report names:
mpi(vader). Its baseline (--baseline) is a small C MPI program built with mpicc at
bench time and run under the same mpirun flags (16 MiB messages four at a time, as the
transport sends them, and two other sizes, each on malloc's and on huge pages; the best counts).

The table goes to stdout; --json, --md and --png write the report, a Markdown document
and a chart. Exit status 1 when a run fails, a transfer fails or verification fails.`

// benchFlags are kvxfer bench's flags that are not settings of the sweep.
type benchFlags struct {
	jsonPath, mdPath, pngPath     string
	verbose, printSchema, withTLS bool
}

func newBenchCmd(e env) *cobra.Command {
	var s bench.Sweep
	var bf benchFlags
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure KV-cache transfers between a context and a generation process",
		Long:  benchLong,
		Example: `  kvxfer bench --model llama-3.1-8b --isl 1024,4096,16384 --backend tcp,auto --baseline \
      --json r.json --md r.md --png r.png`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runBench(cmd, e, &s, &bf) },
	}
	addBenchFlags(cmd.Flags(), &s, &bf)
	cmd.AddCommand(newBenchServeCmd(e), newBenchMPIRankCmd(e))
	return cmd
}

// runBench runs the sweep of the flags and writes its table and reports.
func runBench(cmd *cobra.Command, e env, s *bench.Sweep, bf *benchFlags) error {
	if bf.printSchema {
		_, err := io.WriteString(cmd.OutOrStdout(), bench.ReportSchema())
		return err
	}
	c := &s.Base
	c.Env = config.LoadEnv(e.lookup, e.environ)
	if bf.verbose {
		c.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
	}
	if bf.withTLS {
		s.TLS = []bool{false, true}
	}
	s.Command = commandLine(cmd)
	s.Progress = bench.NewProgress(cmd.ErrOrStderr(), isTerminal(cmd.ErrOrStderr()))
	rep, err := bench.RunSweep(cmd.Context(), *s)
	if rep == nil {
		return err
	}
	fmt.Fprintln(cmd.OutOrStdout())
	if werr := rep.WriteTable(cmd.OutOrStdout()); werr != nil {
		return werr
	}
	writeAgreement(cmd.OutOrStdout(), rep)
	rep.WriteErrors(cmd.ErrOrStderr())
	for _, out := range []struct {
		path  string
		write func(io.Writer) error
	}{{bf.jsonPath, rep.WriteJSON}, {bf.mdPath, rep.WriteMarkdown}, {bf.pngPath, rep.WritePNG}} {
		if out.path == "" {
			continue
		}
		if werr := writeFile(out.path, out.write); werr != nil {
			return werr
		}
	}
	if err != nil {
		return err
	}
	if rep.Failed() {
		return exitError{1}
	}
	return nil
}

// addBenchFlags defines kvxfer bench's flags on f, each defaulting to
// bench.DefaultConfig's value.
func addBenchFlags(f *pflag.FlagSet, s *bench.Sweep, bf *benchFlags) {
	c, d := &s.Base, bench.DefaultConfig()
	f.StringSliceVar(&s.Backends, "backend", []string{d.Backend}, "backends, comma-separated: tcp, shm, ucx, mpi, auto or default (as cache_transceiver_config.backend)")
	f.StringVar(&c.Model, "model", d.Model, "model preset: tiny, llama-3.1-8b, llama-3.1-70b, qwen3-32b, deepseek-v3")
	f.IntSliceVar(&s.ISLs, "isl", []int{d.ISL}, "tokens per request, comma-separated")
	f.IntVar(&c.Requests, "requests", d.Requests, "measured requests per run")
	f.IntVar(&c.Warmup, "warmup", d.Warmup, "requests before measuring, per run")
	f.IntSliceVar(&s.Concurrency, "concurrency", []int{d.Concurrency}, "requests in flight at once, comma-separated")
	f.IntVar(&c.CtxTP, "ctx-tp", d.CtxTP, "context tensor parallel size")
	f.IntVar(&c.CtxPP, "ctx-pp", d.CtxPP, "context pipeline parallel size")
	f.IntVar(&c.GenTP, "gen-tp", d.GenTP, "generation tensor parallel size")
	f.IntVar(&c.GenPP, "gen-pp", d.GenPP, "generation pipeline parallel size")
	f.BoolVar(&c.MLA, "mla", false, "MLA attention (one 576-wide latent head, K only)")
	f.StringSliceVar(&s.DTypes, "dtype", []string{d.DType}, "KV dtypes, comma-separated: fp32, fp16, bf16, fp8, int8")
	f.IntVar(&c.TokensPerBlock, "tokens-per-block", d.TokensPerBlock, "tokens per KV block")
	f.IntVar(&c.MaxTokensInBuffer, "max-tokens-in-buffer", 0, "staging buffer size in tokens (0: TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE)")
	f.BoolVar(&c.Verify, "verify", false, "check every received byte against the reference (requests up to 1 GiB)")
	f.BoolVar(&s.Baseline, "baseline", false, "also measure the machine's limits at their best (copy, raw TCP, iperf3, ucx_perftest) and report kvxfer's ratio to them")
	f.IntVar(&s.Rounds, "rounds", 1, "measure everything this many times, in turns (round k: every baseline, then every run, each with its own context process and warm-up); each figure is the best of its rounds, and each ratio is also given as the median of the per-round ratios")
	f.Int64Var(&s.BaselineBytes, "baseline-bytes", 0, "bytes each baseline moves (0: the largest request, clamped to 64 MiB..1 GiB)")
	f.StringVar(&bf.jsonPath, "json", "", "write the report as JSON to this file (schema: --print-schema)")
	f.StringVar(&bf.mdPath, "md", "", "write the report as Markdown to this file")
	f.StringVar(&bf.pngPath, "png", "", "write a chart of GB/s against ISL per backend, with the baselines, to this PNG file")
	f.BoolVar(&bf.printSchema, "print-schema", false, "print the JSON Schema of the --json report and exit")
	f.BoolVar(&bf.withTLS, "tls", false, "also make every run with mutual TLS on the transfer planes (tcp data and control), next to the same run without, and measure the cipher's limit (openssl speed -evp aes-128-gcm)")
	f.BoolVar(&c.ProcessPerRank, "process-per-rank", false, "run every rank of both instances as its own OS process, the ranks of an instance agreeing over a coordinated group, and report the cost of that cross-process consensus per request")
	f.StringVar(&c.MPIBTL, "mpi-btl", bench.MPIBTLVader, "backend mpi: the OpenMPI component that carries the data, vader (shared memory) or tcp (mpirun --mca pml ob1 --mca btl self,BTL)")
	f.BoolVar(&bf.verbose, "verbose", false, "log the transceivers")
}

// commandLine rebuilds the command from the flags that were set, for the
// report.
func commandLine(cmd *cobra.Command) []string {
	words := []string{"kvxfer", "bench"}
	cmd.Flags().Visit(func(f *pflag.Flag) {
		switch f.Value.Type() {
		case "bool":
			if f.Value.String() == "true" {
				words = append(words, "--"+f.Name)
			} else {
				words = append(words, "--"+f.Name+"=false")
			}
			return
		case "stringSlice", "intSlice":
			v := strings.Trim(f.Value.String(), "[]")
			words = append(words, "--"+f.Name, v)
			return
		}
		words = append(words, "--"+f.Name, f.Value.String())
	})
	return words
}

// isTerminal reports whether w is a character device (a terminal), where a
// progress bar redrawn in place reads well.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// writeFile writes a report file whole or not at all.
func writeFile(path string, write func(io.Writer) error) error {
	var b bytes.Buffer
	if err := write(&b); err != nil {
		return fmt.Errorf("bench: %s: %w", path, err)
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// newBenchPeerCmd is the context side of bench, started by bench itself.
func newBenchPeerCmd(e env) *cobra.Command {
	return &cobra.Command{
		Use:    "bench-peer",
		Short:  "The context process of kvxfer bench (started by bench; reads JSON lines on stdin)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			return bench.PeerMain(cmd.Context(), cmd.InOrStdin(), cmd.OutOrStdout(), config.LoadEnv(e.lookup, e.environ), log)
		},
	}
}

// newBenchMPIRankCmd is what each rank of the MPI world of a run with
// backend mpi runs, under the mpirun that bench starts.
func newBenchMPIRankCmd(e env) *cobra.Command {
	return &cobra.Command{
		Use:    "mpi-rank",
		Short:  "A rank of the MPI world of kvxfer bench --backend mpi (started by bench under mpirun)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if mpiWorld == nil {
				return fmt.Errorf("bench mpi-rank: the MPI backend is not built in this binary: build with -tags mpi (needs libopenmpi-dev)")
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			if err := mpiWorld.init(log); err != nil {
				return err
			}
			rank, size, _ := mpiWorld.world()
			if dir := os.Getenv(envBenchMPIProfile); dir != "" {
				stop, err := cpuProfile(filepath.Join(dir, fmt.Sprintf("rank%d.pprof", rank)))
				if err != nil {
					mpiWorld.abort(1)
					return err
				}
				defer stop()
			}
			if err := bench.MPIRankMain(cmd.Context(), rank, size, config.LoadEnv(e.lookup, e.environ), log); err != nil {
				// The other rank would wait for this one: take the world down.
				fmt.Fprintf(cmd.ErrOrStderr(), "kvxfer: bench mpi-rank %d: %v\n", rank, err)
				mpiWorld.abort(1)
				return err
			}
			return mpiWorld.finalize()
		},
	}
}

// envBenchMPIProfile names a directory where each rank of bench mpi-rank
// writes its CPU profile (rank0.pprof: the generation side, rank1.pprof:
// the context side), to see where a run with backend mpi spends its time.
const envBenchMPIProfile = "KVXFER_BENCH_MPI_CPUPROFILE"

// cpuProfile starts a CPU profile into path; stop ends it.
func cpuProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("bench mpi-rank: %s: %w", envBenchMPIProfile, err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("bench mpi-rank: %s: %w", envBenchMPIProfile, err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// writeAgreement writes, for the runs made with --process-per-rank, what
// the instances' cross-process consensus cost per request.
func writeAgreement(w io.Writer, rep *bench.Report) {
	header := false
	for _, r := range rep.Runs {
		if !r.ProcessPerRank || r.Requests == 0 {
			continue
		}
		if !header {
			fmt.Fprintln(w, "\ncross-process consensus per request (from the last rank's end to the completion in a process; generation: the slowest of its processes; context: every process, warm-up included):")
			header = true
		}
		fmt.Fprintf(w, "  %-40s generation p50 %8.0f µs  p99 %8.0f µs   context p50 %8.0f µs  p99 %8.0f µs\n",
			r.Label(), r.AgreementP50Us, r.AgreementP99Us, r.CtxAgreementP50Us, r.CtxAgreementP99Us)
	}
}
