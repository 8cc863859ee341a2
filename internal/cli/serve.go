package cli

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// logFlags are the logging flags of the long-running verbs.
type logFlags struct{ level, format string }

func (l *logFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&l.level, "log-level", "info", "log level: debug, info, warn, error")
	cmd.Flags().StringVar(&l.format, "log-format", "text", "log format: text or json")
}

func (l *logFlags) logger(cmd *cobra.Command) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(l.level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", l.level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch l.format {
	case "text":
		return slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(cmd.ErrOrStderr(), opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", l.format)
}

// adminFlag is the address of the admin listener (pprof).
type adminFlag struct{ addr string }

func (a *adminFlag) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&a.addr, "admin-addr", "127.0.0.1:0", "admin listener for /debug/pprof/ (loopback by default; \"\" disables it)")
}

// start serves /debug/pprof/ on the admin address until ctx ends or the
// returned stop function is called; stop also waits for the goroutine it
// started.
func (a *adminFlag) start(ctx context.Context, log *slog.Logger) (stop func(), err error) {
	if a.addr == "" {
		return func() {}, nil
	}
	ctx, cancel := context.WithCancel(ctx)
	ln, err := net.Listen("tcp", a.addr)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("--admin-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	log.Info("listening", "plane", "admin", "addr", ln.Addr().String(), "pprof", "http://"+ln.Addr().String()+"/debug/pprof/")
	ln = serve.LimitListener(ln, "admin", serve.HTTPLimits{}, log, nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHTTP(ctx, ln, serve.NewHTTPServer(mux, serve.HTTPLimits{}), slog.New(slog.DiscardHandler))
	}()
	return func() { cancel(); <-done }, nil
}

// serveHTTP runs srv on ln until ctx ends, then shuts down gracefully.
func serveHTTP(ctx context.Context, ln net.Listener, srv *http.Server, log *slog.Logger) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := srv.Shutdown(sctx)
	<-errc
	return err
}

func newServeCmd(e env) *cobra.Command {
	var (
		role, cfgPath, model, host, dtype, txHost string
		port, tp, pp                              int
		lf                                        logFlags
		admin                                     adminFlag
		tf                                        tlsFlags
		hf                                        httpFlags
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an OpenAI-compatible worker: --role context, generation or both",
		Long: `serve runs one worker: a sharded instance of the reference model (TP x PP ranks in this
process), its cache transceiver (from the worker file's cache_transceiver_config) and an
OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) with TensorRT-LLM's disaggregated_params.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger(cmd)
			if err != nil {
				return err
			}
			envSnap := config.LoadEnv(e.lookup, e.environ)
			var wc *config.Worker
			if cfgPath != "" {
				f, err := config.LoadFile(cfgPath, envSnap)
				if err != nil {
					return err
				}
				if f.Kind != config.KindWorker {
					return fmt.Errorf("%s is a %s file; serve takes a worker file (kvxfer router and kvxfer up take cluster files)", cfgPath, f.Kind)
				}
				for _, w := range f.Warnings {
					log.Warn(w.String())
				}
				wc = f.Worker
			} else {
				wc = &config.Worker{TensorParallelSize: 1, PipelineParallelSize: 1,
					KVCache: config.KVCache{TokensPerBlock: config.DefaultTokensPerBlock, MaxTokens: config.DefaultPoolTokens}}
				if wc.Security, err = config.SecurityFromEnv(envSnap); err != nil {
					return err
				}
				if role != serve.RoleBoth {
					ct, err := config.NewCacheTransceiver("DEFAULT", wc.KVCache.TokensPerBlock, envSnap)
					if err != nil {
						return err
					}
					wc.CacheTransceiver = ct
				}
			}
			if cmd.Flags().Changed("tp") {
				wc.TensorParallelSize = tp
			}
			if cmd.Flags().Changed("pp") {
				wc.PipelineParallelSize = pp
			}
			dt, err := kvcache.ParseDType(dtype)
			if err != nil {
				return err
			}
			secret, err := loadSecret(&wc.Security, envSnap, log)
			if err != nil {
				return err
			}
			tc, err := tf.loadOr(wc.Security.TLS)
			if err != nil {
				return err
			}
			w, err := serve.NewWorker(cmd.Context(), serve.WorkerOptions{Role: role, Model: model, Config: wc, DType: dt,
				TransceiverHost: txHost, Logger: log, Secret: secret, AllowedPeerHosts: wc.Security.AllowedPeerHosts, TLS: tc})
			if err != nil {
				return err
			}
			defer w.Close()
			if tr := w.Transceiver(); tr != nil {
				for _, l := range tr.Listeners() {
					log.Info("listening", "plane", l.Plane, "rank", l.Rank, "addr", l.Addr)
				}
				log.Info("transceiver connection limits", "limits", tr.Limits().String())
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil {
				return err
			}
			log.Info("listening", "plane", "http", "addr", ln.Addr().String(), "limits", hf.lim.WithDefaults())
			ln = serve.LimitListener(ln, "worker http", hf.lim, log, w.Metrics().Conns)
			scheme := "http://"
			if tc != nil {
				ln, scheme = tls.NewListener(ln, tc.Server), "https://"
			}
			wait, err := admin.start(cmd.Context(), log)
			if err != nil {
				return err
			}
			defer wait()
			log.Info("worker listening", "role", role, "model", model, "url", scheme+ln.Addr().String(),
				"tp", wc.TensorParallelSize, "pp", wc.PipelineParallelSize, "mutual_tls", tc != nil)
			return serveHTTP(cmd.Context(), ln, serve.NewHTTPServer(w.Handler(), hf.lim), log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&role, "role", serve.RoleBoth, "context, generation or both")
	f.StringVar(&cfgPath, "config", "", "worker file (TensorRT-LLM extra LLM API options YAML)")
	f.StringVar(&model, "model", "tiny-gqa", "model preset: tiny-gqa, tiny-gqa2, tiny-mla")
	f.StringVar(&host, "host", "127.0.0.1", "HTTP listen host")
	f.IntVar(&port, "port", 8001, "HTTP listen port")
	f.IntVar(&tp, "tp", 1, "tensor parallel size (overrides the file)")
	f.IntVar(&pp, "pp", 1, "pipeline parallel size (overrides the file)")
	f.StringVar(&dtype, "dtype", "bf16", "KV cache dtype: fp32, fp16, bf16, fp8")
	f.StringVar(&txHost, "transceiver-host", "127.0.0.1", "address the transceiver's control and data listeners bind to")
	tf.add(cmd, "on the HTTP API (clients need a certificate of the CA) and the transceiver's control and tcp data connections")
	lf.add(cmd)
	admin.add(cmd)
	hf.add(cmd)
	return cmd
}

// loadSecret reads the cluster secret the security block points at and logs
// where it came from and its length (never the secret).
func loadSecret(sec *config.Security, env config.Env, log *slog.Logger) ([]byte, error) {
	secret, src, err := sec.LoadSecret(env)
	if err != nil {
		return nil, err
	}
	if secret != nil {
		log.Info("cluster secret loaded", "from", src, "bytes", len(secret))
	}
	return secret, nil
}

func loadCluster(path string, e env) (*config.Cluster, error) {
	envSnap := config.LoadEnv(e.lookup, e.environ)
	var f *config.File
	var err error
	if path == "" {
		f, err = config.LoadBytes("(embedded default cluster)", serve.DefaultCluster, envSnap)
	} else {
		f, err = config.LoadFile(path, envSnap)
	}
	if err != nil {
		return nil, err
	}
	if f.Kind != config.KindCluster {
		return nil, fmt.Errorf("%s is a worker file; this verb takes a cluster file (disagg_config.yaml with context_servers and generation_servers)", path)
	}
	return f.Cluster, nil
}

func newRouterCmd(e env) *cobra.Command {
	var (
		cfgPath, host string
		port          int
		lf            logFlags
		admin         adminFlag
		tf            tlsFlags
		hf            httpFlags
	)
	cmd := &cobra.Command{
		Use:   "router",
		Short: "Run the disaggregated router in front of running workers (cluster file with urls)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger(cmd)
			if err != nil {
				return err
			}
			if cfgPath == "" {
				return errors.New("--config: a cluster file with context_servers.urls and generation_servers.urls is required")
			}
			cl, err := loadCluster(cfgPath, e)
			if err != nil {
				return err
			}
			if len(cl.Context.URLs) == 0 || len(cl.Generation.URLs) == 0 {
				return fmt.Errorf("%s: the router needs context_servers.urls and generation_servers.urls (kvxfer up starts workers and picks ports itself)", cfgPath)
			}
			tc, err := tf.loadOr(cl.Security.TLS)
			if err != nil {
				return err
			}
			ro := serve.RouterOptions{Context: cl.Context.URLs, Generation: cl.Generation.URLs,
				ContextPolicy: serve.Policy(cl.Context.Router), GenerationPolicy: serve.Policy(cl.Generation.Router), Logger: log}
			if tc != nil {
				ro.TLS = tc.Client
			}
			r, err := serve.NewRouter(ro)
			if err != nil {
				return err
			}
			defer r.Close()
			if host == "" {
				host = cl.Hostname
			}
			if !cmd.Flags().Changed("port") {
				port = cl.Port
			}
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
			if err != nil {
				return err
			}
			log.Info("listening", "plane", "http", "addr", ln.Addr().String(), "limits", hf.lim.WithDefaults())
			ln = serve.LimitListener(ln, "router http", hf.lim, log, metrics.NewConns(r.Registry()))
			wait, err := admin.start(cmd.Context(), log)
			if err != nil {
				return err
			}
			defer wait()
			log.Info("router listening", "url", "http://"+ln.Addr().String(), "context", cl.Context.URLs, "generation", cl.Generation.URLs)
			return serveHTTP(cmd.Context(), ln, serve.NewHTTPServer(r.Handler(), hf.lim), log)
		},
	}
	cmd.Flags().StringVar(&cfgPath, "config", "", "cluster file (disagg_config.yaml)")
	cmd.Flags().StringVar(&host, "host", "", "listen host (default: the file's hostname)")
	cmd.Flags().IntVar(&port, "port", 8000, "listen port (default: the file's port)")
	tf.add(cmd, "to the workers (the router's own listener stays plain HTTP)")
	lf.add(cmd)
	admin.add(cmd)
	hf.add(cmd)
	return cmd
}

func newUpCmd(e env) *cobra.Command {
	var (
		file, model, host string
		port, smoke       int
		quiet, genTLS     bool
		lf                logFlags
		tf                tlsFlags
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Start a local disaggregated cluster: every worker as its own process, plus the router",
		Long: `up starts the workers of a cluster file (default: context TP2 -> generation TP1 with the
GQA model, backend DEFAULT) as separate processes, waits until they are healthy, and serves
the OpenAI-compatible router until Ctrl-C, when it stops every worker. With --smoke N it
also starts an aggregated worker, sends N prompts through the router and to it, checks that
every answer is the same, prints TTFT with and without disaggregation, and exits 0 or 1.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger(cmd)
			if err != nil {
				return err
			}
			cl, err := loadCluster(file, e)
			if err != nil {
				return err
			}
			out := cmd.ErrOrStderr()
			if quiet || smoke > 0 {
				out = nil
			}
			if cmd.Flags().Changed("port") {
				cl.Port = port
			}
			if smoke > 0 && !cmd.Flags().Changed("port") {
				cl.Port = -1 // any free port: a smoke run must not clash with a running cluster
			}
			if host != "" {
				cl.Hostname = host
			}
			if genTLS && tf.or(cl.Security.TLS).Enabled() {
				return fmt.Errorf("--tls makes the cluster's certificates; it does not go with --tls-cert/--tls-key/--tls-ca or security.tls")
			}
			// The cluster's own secret when it names one (or
			// KVXFER_CLUSTER_SECRET is set); else Launch makes one.
			secret, err := loadSecret(&cl.Security, config.LoadEnv(e.lookup, e.environ), log)
			if err != nil {
				return err
			}
			if secret == nil {
				log.Info("cluster secret: generated for this cluster, handed to the workers in their environment")
			}
			l, err := serve.Launch(cmd.Context(), serve.LaunchOptions{Cluster: cl, Model: model, Aggregated: smoke > 0,
				Output: out, Logger: log, Secret: secret, TLS: tf.or(cl.Security.TLS), GenerateTLS: genTLS})
			if err != nil {
				return err
			}
			defer l.Stop()
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "kvxfer cluster up: %d context and %d generation workers (model %s)\n", len(l.ContextURLs), len(l.GenerationURL), model)
			for name, pid := range l.Workers() {
				fmt.Fprintf(w, "  worker %-14s pid %d\n", name, pid)
			}
			fmt.Fprintf(w, "  context:    %s\n  generation: %s\n  router:     %s\n", strings.Join(l.ContextURLs, " "), strings.Join(l.GenerationURL, " "), l.RouterURL)
			if smoke > 0 {
				res := serve.SmokeWith(cmd.Context(), l.Client(), l.RouterURL, l.AggregatedURL, smoke, 4)
				printSmoke(w, res)
				if !res.OK() {
					return exitError{1}
				}
				return nil
			}
			fmt.Fprintf(w, "\ntry:\n  curl -N %s/v1/completions -H 'Content-Type: application/json' \\\n    -d '{\"model\":\"%s\",\"prompt\":\"Hello\",\"max_tokens\":32,\"stream\":true}'\n\nCtrl-C stops every worker.\n", l.RouterURL, model)
			<-cmd.Context().Done()
			fmt.Fprintln(w, "stopping the cluster")
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&file, "file", "f", "", "cluster file (disagg_config.yaml); default: the embedded one")
	f.StringVar(&model, "model", "tiny-gqa", "model preset every worker serves: tiny-gqa, tiny-gqa2, tiny-mla")
	f.StringVar(&host, "host", "", "router host (default: the file's hostname)")
	f.IntVar(&port, "port", 8000, "router port (default: the file's port)")
	f.IntVar(&smoke, "smoke", 0, "send N prompts through the router and to an aggregated worker, compare, exit 0 or 1")
	f.BoolVar(&quiet, "quiet", false, "do not show the workers' logs")
	f.BoolVar(&genTLS, "tls", false, "mutual TLS between the router and the workers and on their tcp transfer planes, with certificates made for this cluster")
	tf.add(cmd, "between the router and the workers and on their transfer planes, one certificate for all")
	lf.add(cmd)
	return cmd
}

func printSmoke(w interface{ Write([]byte) (int, error) }, r *serve.SmokeResult) {
	fmt.Fprintf(w, "\nsmoke: %d/%d answers equal to the aggregated worker's\n", r.Matched, r.Prompts)
	for _, f := range r.Failures {
		fmt.Fprintf(w, "  FAIL %s\n", f)
	}
	if len(r.TTFTDisagg) > 0 {
		fmt.Fprintf(w, "\n| TTFT (streamed) | p50 | p99 |\n|---|---|---|\n")
		fmt.Fprintf(w, "| aggregated worker (TP1) | %.1f ms | %.1f ms |\n", ms(serve.Percentile(r.TTFTAgg, 50)), ms(serve.Percentile(r.TTFTAgg, 99)))
		fmt.Fprintf(w, "| disaggregated via router | %.1f ms | %.1f ms |\n", ms(serve.Percentile(r.TTFTDisagg, 50)), ms(serve.Percentile(r.TTFTDisagg, 99)))
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
