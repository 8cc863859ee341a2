package cli

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// upFlags are kvxfer up's flags.
type upFlags struct {
	file, model, host string
	port, smoke       int
	quiet, genTLS     bool
	lf                logFlags
	tf                tlsFlags
	df                deadlineFlags
	mf                migrationFlag
}

func newUpCmd(e env) *cobra.Command {
	var uf upFlags
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Start a local disaggregated cluster: every worker as its own process, plus the router",
		Long: `up starts the workers of a cluster file (default: context TP2 -> generation TP1 with the
GQA model, backend DEFAULT) as separate processes, waits until they are healthy, and serves
the OpenAI-compatible router until Ctrl-C, when it stops every worker, or until a server
group has no worker left running: it then stops the others and exits non-zero, naming the
workers that exited and showing their last lines. With --smoke N it
also starts an aggregated worker, sends N prompts through the router and to it, streamed and
not, checks that every answer has the same token ids (max_tokens of them, with ignore_eos)
and text, prints TTFT with and without disaggregation, and exits 0 or 1. When a generation
worker dies mid-request, the router migrates the request to another one (--migration-limit).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runUp(cmd, e, &uf) },
	}
	f := cmd.Flags()
	f.StringVarP(&uf.file, "file", "f", "", "cluster file (disagg_config.yaml); default: the embedded one")
	f.StringVar(&uf.model, "model", serve.DefaultModel, "model preset every worker serves: tiny-gqa, tiny-gqa2, tiny-mla")
	f.StringVar(&uf.host, "host", "", "router host (default: the file's hostname)")
	f.IntVar(&uf.port, "port", config.DefaultPort, "router port (default: the file's port)")
	f.IntVar(&uf.smoke, "smoke", 0, "send N prompts through the router and to an aggregated worker, compare, exit 0 or 1")
	f.BoolVar(&uf.quiet, "quiet", false, "do not show the workers' logs")
	f.BoolVar(&uf.genTLS, "tls", false, "mutual TLS between the router and the workers and on their tcp transfer planes, with certificates made for this cluster")
	uf.tf.add(cmd, "between the router and the workers and on their transfer planes, one certificate for all")
	uf.lf.add(cmd)
	uf.df.add(cmd)
	uf.mf.add(cmd)
	return cmd
}

// runUp launches the cluster of the flags, then runs the smoke check or
// waits for the command's context to end.
func runUp(cmd *cobra.Command, e env, uf *upFlags) error {
	log, err := uf.lf.logger(cmd)
	if err != nil {
		return err
	}
	cl, err := loadCluster(uf.file, e, log)
	if err != nil {
		return err
	}
	out := cmd.ErrOrStderr()
	if uf.quiet || uf.smoke > 0 {
		out = nil
	}
	if cmd.Flags().Changed("port") {
		cl.Port = uf.port
	}
	if uf.smoke > 0 && !cmd.Flags().Changed("port") {
		cl.Port = -1 // any free port: a smoke run must not clash with a running cluster
	}
	if uf.host != "" {
		cl.Hostname = uf.host
	}
	if uf.genTLS && uf.tf.or(cl.Security.TLS).Enabled() {
		return fmt.Errorf("--tls makes the cluster's certificates; it does not go with --tls-cert/--tls-key/--tls-ca or security.tls")
	}
	// The cluster's own secret when it names one (or
	// KVXFER_CLUSTER_SECRET is set); else Start makes one.
	secret, err := loadSecret(&cl.Security, config.LoadEnv(e.lookup, e.environ), log)
	if err != nil {
		return err
	}
	if secret == nil {
		log.Info("cluster secret: generated for this cluster, handed to the workers in their environment")
	}
	// A second signal while the cluster stops kills its workers at once,
	// also while it is still starting (a failed Start stops them).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	w := cmd.OutOrStdout()
	kill, started := make(chan struct{}), make(chan struct{})
	during := make(chan int, 1) // the signals that came while starting
	go func() {
		got := 0
		defer func() { during <- got }()
		for {
			select {
			case sig := <-sigs:
				if got++; got >= 2 {
					fmt.Fprintf(w, "%v while starting: killing every worker now\n", sig)
					close(kill)
					return
				}
			case <-started:
				return
			}
		}
	}()
	l, err := launch.Start(cmd.Context(), launch.Options{Cluster: cl, Model: uf.model, Aggregated: uf.smoke > 0,
		Output: out, Logger: log, Secret: secret, TLS: uf.tf.or(cl.Security.TLS), GenerateTLS: uf.genTLS,
		Deadlines: serve.RouterDeadlines(uf.df), MigrationLimit: uf.mf.limit(), Kill: kill})
	close(started)
	got := <-during
	if err != nil {
		return err
	}
	defer func() {
		// The signal that ended the command's context is not the second,
		// and one that came while the cluster started counts.
		need := 1
		if cmd.Context().Err() != nil {
			need = 2
		}
		stopCluster(l, sigs, max(need-got, 1), w)
	}()
	printCluster(w, l, uf.model)
	if uf.smoke > 0 {
		res := launch.SmokeWith(cmd.Context(), l.Client(), l.RouterURL, l.AggregatedURL, uf.smoke, 4)
		printSmoke(w, res)
		if !res.OK() {
			return exitError{1}
		}
		return nil
	}
	fmt.Fprintf(w, "\ntry:\n  curl -N %s/v1/completions -H 'Content-Type: application/json' \\\n    -d '{\"model\":\"%s\",\"prompt\":\"Hello\",\"max_tokens\":32,\"stream\":true}'\n\nCtrl-C stops every worker.\n", l.RouterURL, uf.model)
	// Until Ctrl-C, or until a server group has no worker left or the
	// router stops serving (up then exits non-zero, naming it, for a
	// supervisor to restart).
	if err := l.Wait(cmd.Context()); err != nil {
		return err
	}
	fmt.Fprintln(w, "stopping the cluster")
	return nil
}

// stopper is what stopCluster stops: a *launch.Launched.
type stopper interface {
	Stop()
	Kill()
}

// stopCluster stops l, and kills it at once when the need-th signal of
// sigs comes in before the stop ends (need is 2 when a signal began it).
func stopCluster(l stopper, sigs <-chan os.Signal, need int, w io.Writer) {
	done := make(chan struct{})
	go func() {
		l.Stop()
		close(done)
	}()
	for got := 0; ; {
		select {
		case <-done:
			return
		case sig := <-sigs:
			if got++; got >= need {
				fmt.Fprintf(w, "%v while stopping: killing every worker now\n", sig)
				l.Kill()
				<-done
				return
			}
		}
	}
}

// printCluster lists the workers and the URLs of a launched cluster.
func printCluster(w io.Writer, l *launch.Launched, model string) {
	fmt.Fprintf(w, "kvxfer cluster up: %d context and %d generation workers (model %s)\n", len(l.ContextURLs), len(l.GenerationURL), model)
	for name, pid := range l.Workers() {
		fmt.Fprintf(w, "  worker %-14s pid %d\n", name, pid)
	}
	fmt.Fprintf(w, "  context:    %s\n  generation: %s\n  router:     %s\n", strings.Join(l.ContextURLs, " "), strings.Join(l.GenerationURL, " "), l.RouterURL)
}

func printSmoke(w interface{ Write([]byte) (int, error) }, r *launch.SmokeResult) {
	fmt.Fprintf(w, "\nsmoke: %d/%d answers equal to the aggregated worker's\n", r.Matched, r.Prompts)
	for _, f := range r.Failures {
		fmt.Fprintf(w, "  FAIL %s\n", f)
	}
	if len(r.TTFTDisagg) > 0 {
		fmt.Fprintf(w, "\n| TTFT (streamed) | p50 | p99 |\n|---|---|---|\n")
		fmt.Fprintf(w, "| aggregated worker (TP1) | %.1f ms | %.1f ms |\n", ms(launch.Percentile(r.TTFTAgg, 50)), ms(launch.Percentile(r.TTFTAgg, 99)))
		fmt.Fprintf(w, "| disaggregated via router | %.1f ms | %.1f ms |\n", ms(launch.Percentile(r.TTFTDisagg, 50)), ms(launch.Percentile(r.TTFTDisagg, 99)))
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
