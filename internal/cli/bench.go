package cli

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"text/tabwriter"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/config"
	"github.com/spf13/cobra"
)

func newBenchCmd(e env) *cobra.Command {
	var c bench.Config
	var jsonPath string
	var verbose bool
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure KV-cache transfers between a context and a generation process",
		Long: `bench starts a context instance as a child process, has it prefill requests with
known contents, pulls them into a generation instance in this process over the chosen
backend, and reports bytes, GB/s (1e9 bytes/s over the measured phase, after a warm-up),
p50/p99 latency per request and the backend that carried the data. With --verify every
generation byte is checked against the naive reference sharding. Exit status 1 when a
transfer fails or verification fails.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c.Env = config.LoadEnv(e.lookup, e.environ)
			c.Progress = cmd.ErrOrStderr()
			if verbose {
				c.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			}
			res, err := bench.Run(cmd.Context(), c)
			if err != nil && res == nil {
				return err
			}
			printResult(cmd, res)
			if jsonPath != "" {
				b, _ := json.MarshalIndent(res, "", "  ")
				if werr := os.WriteFile(jsonPath, append(b, '\n'), 0o644); werr != nil {
					return werr
				}
			}
			if err != nil {
				return err
			}
			if res.Errors > 0 || (c.Verify && !res.Verified) {
				return exitError{1}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&c.Backend, "backend", "tcp", "backend: tcp, shm, ucx, auto or default (as cache_transceiver_config.backend)")
	f.StringVar(&c.Model, "model", "tiny", "model preset: tiny, llama-3.1-8b, llama-3.1-70b, qwen3-32b, deepseek-v3")
	f.IntVar(&c.ISL, "isl", 4096, "tokens per request")
	f.IntVar(&c.Requests, "requests", 8, "measured requests")
	f.IntVar(&c.Warmup, "warmup", 1, "requests before measuring")
	f.IntVar(&c.Concurrency, "concurrency", 1, "requests in flight at once")
	f.IntVar(&c.CtxTP, "ctx-tp", 1, "context tensor parallel size")
	f.IntVar(&c.CtxPP, "ctx-pp", 1, "context pipeline parallel size")
	f.IntVar(&c.GenTP, "gen-tp", 1, "generation tensor parallel size")
	f.IntVar(&c.GenPP, "gen-pp", 1, "generation pipeline parallel size")
	f.BoolVar(&c.MLA, "mla", false, "MLA attention (one 576-wide latent head, K only)")
	f.StringVar(&c.DType, "dtype", "bf16", "KV dtype: fp32, fp16, bf16, fp8, int8")
	f.IntVar(&c.TokensPerBlock, "tokens-per-block", 32, "tokens per KV block")
	f.IntVar(&c.MaxTokensInBuffer, "max-tokens-in-buffer", 0, "staging buffer size in tokens (0: TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE)")
	f.BoolVar(&c.Verify, "verify", false, "check every received byte against the reference")
	f.BoolVar(&c.Baseline, "baseline", false, "also measure a raw loopback TCP stream and a memory copy of the same bytes, and report the ratios")
	f.StringVar(&jsonPath, "json", "", "write the report as JSON to this file")
	f.BoolVar(&verbose, "verbose", false, "log the transceivers")
	return cmd
}

func printResult(cmd *cobra.Command, r *bench.Result) {
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tISL\tCTX\tGEN\tBACKEND\tREQUESTS\tBYTES/REQ\tGB/s\tXFER/s\tP50 ms\tP99 ms\tVERIFIED\tERRORS")
	verified := "-"
	if r.Verified {
		verified = "yes"
	} else if r.Errors > 0 {
		verified = "no"
	}
	fmt.Fprintf(tw, "%s\t%d\tTP%d PP%d\tTP%d PP%d\t%s\t%d\t%d\t%.2f\t%.0f\t%.2f\t%.2f\t%s\t%d\n",
		r.Model, r.ISL, r.Ctx.TP, r.Ctx.PP, r.Gen.TP, r.Gen.PP, r.Backend, r.Requests, r.BytesPerReq, r.GBps, r.TransfersPerS, r.P50Ms, r.P99Ms, verified, r.Errors)
	tw.Flush()
	if b := r.Baselines; b != nil {
		fmt.Fprintf(cmd.OutOrStdout(), "baselines: raw TCP stream %.2f GB/s (kvxfer %.2fx), single-thread copy %.2f GB/s (kvxfer %.2fx)\n",
			b.RawTCPGBps, r.RatioRawTCP, b.CopyGBps, r.RatioCopy)
	}
	for _, m := range r.ErrorMessages {
		fmt.Fprintln(cmd.ErrOrStderr(), "error:", m)
	}
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
