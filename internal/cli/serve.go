package cli

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/kvxfer/kvxfer/transceiver"
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

// httpDrain is how long serveHTTP lets requests in flight finish once
// its context ends.
const httpDrain = 10 * time.Second

// serveHTTP runs srv on ln until ctx ends, then shuts down gracefully:
// it stops accepting, runs onShutdown (which ends what would otherwise hold
// a connection open to the end: the built-in store's long polls), lets the
// requests in flight finish for up to httpDrain and then closes them,
// saying so. A stop asked for is not an error, however it ends.
func serveHTTP(ctx context.Context, ln net.Listener, srv *http.Server, log *slog.Logger, onShutdown ...func()) error {
	for _, f := range onShutdown {
		if f != nil {
			srv.RegisterOnShutdown(f)
		}
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), httpDrain)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("requests still in flight at the end of the drain: closed", "drain", httpDrain, "err", err)
		srv.Close()
	}
	<-errc
	return nil
}

// serveFlags are kvxfer serve's flags.
type serveFlags struct {
	role, cfgPath, model, host, dtype, txHost string
	advertise                                 string
	port, tp, pp                              int
	listenFD                                  int
	lf                                        logFlags
	admin                                     adminFlag
	tf                                        tlsFlags
	hf                                        httpFlags
	// cfgRead, when set, runs once the worker file has been read (or
	// failed to): serve-mpi removes the file it wrote for the rank.
	cfgRead func()
}

func newServeCmd(e env) *cobra.Command {
	var sf serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run an OpenAI-compatible worker: --role context, generation or both",
		Long: `serve runs one worker: a sharded instance of the reference model (TP x PP ranks in this
process), its cache transceiver (from the worker file's cache_transceiver_config) and an
OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) with TensorRT-LLM's disaggregated_params.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runServe(cmd, e, &sf) },
	}
	sf.add(cmd)
	return cmd
}

func (sf *serveFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&sf.role, "role", serve.RoleBoth, "context, generation or both")
	f.StringVar(&sf.cfgPath, "config", "", "worker file (TensorRT-LLM extra LLM API options YAML)")
	f.StringVar(&sf.model, "model", serve.DefaultModel, "model preset: tiny-gqa, tiny-gqa2, tiny-mla")
	f.StringVar(&sf.host, "host", "127.0.0.1", "HTTP listen host")
	f.IntVar(&sf.port, "port", 8001, "HTTP listen port")
	f.IntVar(&sf.listenFD, "listen-fd", 0, "serve HTTP on this inherited listening socket instead of --host/--port (for launchers such as kvxfer up, which bind the port first so that nothing else can take it)")
	f.IntVar(&sf.tp, "tp", 1, "tensor parallel size (overrides the file)")
	f.IntVar(&sf.pp, "pp", 1, "pipeline parallel size (overrides the file)")
	f.StringVar(&sf.dtype, "dtype", "bf16", "KV cache dtype: fp32, fp16, bf16, fp8")
	f.StringVar(&sf.txHost, "transceiver-host", "127.0.0.1", "address the transceiver's control and data listeners bind to")
	f.StringVar(&sf.advertise, "advertise-host", "", "host of the URL the worker registers in its disagg_cluster (default: --host; for 0.0.0.0, this host's name or first non-loopback IPv4)")
	sf.tf.add(cmd, "on the HTTP API (clients need a certificate of the CA) and the transceiver's control and tcp data connections")
	sf.lf.add(cmd)
	sf.admin.add(cmd)
	sf.hf.add(cmd)
}

// runServe builds the worker of the flags and serves its HTTP API until the
// command's context ends.
func runServe(cmd *cobra.Command, e env, sf *serveFlags) error {
	log, err := sf.lf.logger(cmd)
	if err != nil {
		return err
	}
	envSnap := config.LoadEnv(e.lookup, e.environ)
	wc, err := sf.workerConfig(cmd, envSnap, log)
	if err != nil {
		return err
	}
	dt, err := kvcache.ParseDType(sf.dtype)
	if err != nil {
		return err
	}
	secret, err := loadSecret(&wc.Security, envSnap, log)
	if err != nil {
		return err
	}
	tc, err := sf.tf.loadOr(wc.Security.TLS)
	if err != nil {
		return err
	}
	faults, err := dataPlaneFaults()
	if err != nil {
		return err
	}
	if faults != nil {
		log.Warn("data planes with injected faults (a chaos build)", "plan", os.Getenv("KVXFER_FAULTS"))
	}
	w, err := serve.NewWorker(cmd.Context(), serve.WorkerOptions{Role: sf.role, Model: sf.model, Config: wc, DType: dt,
		TransceiverHost: sf.txHost, Logger: log, Secret: secret, AllowedPeerHosts: wc.Security.AllowedPeerHosts, TLS: tc,
		WrapDataPlane: faults})
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
	ln, err := sf.httpListener()
	if err != nil {
		return err
	}
	log.Info("listening", "plane", "http", "addr", ln.Addr().String(), "limits", sf.hf.lim.WithDefaults())
	ln = serve.LimitListener(ln, "worker http", sf.hf.lim, log, w.Metrics().Conns)
	scheme := "http://"
	if tc != nil {
		ln, scheme = tls.NewListener(ln, tc.Server), "https://"
	}
	wait, err := sf.admin.start(cmd.Context(), log)
	if err != nil {
		return err
	}
	defer wait()
	log.Info("worker listening", "role", sf.role, "model", sf.model, "url", scheme+ln.Addr().String(),
		"tp", wc.TensorParallelSize, "pp", wc.PipelineParallelSize, "mutual_tls", tc != nil)
	return serveWorker(cmd.Context(), sf, wc, w, ln, scheme, secret, log)
}

// serveWorker serves the worker's HTTP API on ln until ctx ends. With
// disagg_cluster it registers once the server runs, and on SIGTERM leaves
// gracefully (see leaveGrace): deregisters first, then drains.
func serveWorker(ctx context.Context, sf *serveFlags, wc *config.Worker, w *serve.Worker, ln net.Listener, scheme string, secret []byte, log *slog.Logger) error {
	// Which signal ended ctx (kvxfer's main cancels it on both).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	srv := serve.NewHTTPServer(w.Handler(), sf.hf.lim)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	j, err := joinCluster(ctx, sf, wc, w, ln, scheme, secret, log)
	if err != nil {
		srv.Close()
		return err
	}
	select {
	case err := <-errc:
		if j != nil {
			j.leave(2 * time.Second)
		}
		return err
	case <-ctx.Done():
	}
	sig := endingSignal(sigs)
	drain := termDrain
	if sig == "SIGINT" {
		drain = intDrain
	}
	deadline := time.Now().Add(drain)
	log.Info("leaving: deregistering, then finishing what is in flight", "signal", sig, "drain", drain)
	if j != nil && j.leave(min(2*time.Second, drain/2)) {
		// Requests the router sent before it saw the leave still land.
		time.Sleep(min(leaveGrace, time.Until(deadline)/2))
	}
	sctx, cancel := context.WithDeadline(context.Background(), deadline)
	err = srv.Shutdown(sctx)
	cancel()
	if err != nil {
		log.Warn("requests still in flight at the drain deadline: closed", "err", err)
		srv.Close()
	}
	<-errc
	if tr := w.Transceiver(); tr != nil {
		waitHeldContext(tr, wc, sig, deadline, log)
	}
	log.Info("worker stopped", "signal", sig)
	return nil
}

// joinCluster starts the worker's membership in wc's disagg_cluster, with
// the URL it is reached at on ln; it is nil, with no error, without
// disagg_cluster.
func joinCluster(ctx context.Context, sf *serveFlags, wc *config.Worker, w *serve.Worker, ln net.Listener, scheme string, secret []byte, log *slog.Logger) (*joiner, error) {
	dc := wc.DisaggCluster
	if dc == nil {
		return nil, nil
	}
	host, err := advertiseHost(sf.advertise, sf.host)
	if err != nil {
		return nil, err
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	rec, err := w.MemberRecord(scheme + net.JoinHostPort(host, port))
	if err != nil {
		return nil, err
	}
	j, err := startJoin(ctx, dc, rec, secret, wc.Security.Etcd, log)
	if err != nil {
		return nil, err
	}
	log.Info("joining the cluster", "cluster_uri", dc.ClusterURI, "cluster_name", dc.ClusterName, "advertised_url", rec.URL,
		"layout_fingerprint", rec.LayoutFingerprint, "backends", rec.Backends)
	return j, nil
}

// endingSignal names what ended the worker's context: "SIGINT",
// "SIGTERM", or "cancel" when no signal arrives soon after.
func endingSignal(sigs <-chan os.Signal) string {
	select {
	case s := <-sigs:
		if s == syscall.SIGINT {
			return "SIGINT"
		}
		return s.String()
	case <-time.After(50 * time.Millisecond):
		return "cancel"
	}
}

// waitHeldContext waits for the context requests whose KV is not pulled
// yet: until pulled or expired (kv_transfer_timeout_ms), within the drain
// deadline of a SIGINT.
func waitHeldContext(tr *transceiver.Transceiver, wc *config.Worker, sig string, deadline time.Time, log *slog.Logger) {
	held := deadline
	if sig != "SIGINT" && wc.CacheTransceiver != nil && wc.CacheTransceiver.KVTransferTimeoutMs > 0 {
		held = time.Now().Add(time.Duration(wc.CacheTransceiver.KVTransferTimeoutMs) * time.Millisecond)
	}
	if n := tr.PendingContext(); n > 0 {
		log.Info("waiting for held context requests to be pulled", "held", n, "until", held.Format(time.RFC3339))
	}
	for tr.PendingContext() > 0 && time.Now().Before(held) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := tr.PendingContext(); n > 0 {
		log.Warn("context requests still held at exit: their generation workers will not get their KV", "held", n)
	}
}

// workerConfig is the worker file of --config; without one, the default
// worker with the security block of the environment and, unless the role
// is both, backend DEFAULT. --tp and --pp override either.
func (sf *serveFlags) workerConfig(cmd *cobra.Command, envSnap config.Env, log *slog.Logger) (*config.Worker, error) {
	var wc *config.Worker
	if sf.cfgPath != "" {
		f, err := config.LoadFile(sf.cfgPath, envSnap)
		if sf.cfgRead != nil {
			sf.cfgRead()
		}
		if err != nil {
			return nil, err
		}
		if f.Kind != config.KindWorker {
			return nil, fmt.Errorf("%s is a %s file; serve takes a worker file (kvxfer router and kvxfer up take cluster files)", sf.cfgPath, f.Kind)
		}
		for _, w := range f.Warnings {
			log.Warn(w.String())
		}
		wc = f.Worker
	} else {
		wc = config.DefaultWorker()
		var err error
		if wc.Security, err = config.SecurityFromEnv(envSnap); err != nil {
			return nil, err
		}
		if sf.role != serve.RoleBoth {
			if wc.CacheTransceiver, err = config.NewCacheTransceiver(string(config.BackendDefault), wc.KVCache.TokensPerBlock, envSnap); err != nil {
				return nil, err
			}
		}
	}
	if cmd.Flags().Changed("tp") {
		wc.TensorParallelSize = sf.tp
	}
	if cmd.Flags().Changed("pp") {
		wc.PipelineParallelSize = sf.pp
	}
	return wc, nil
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

// loadCluster loads the cluster file at path (the embedded default for "")
// and logs its warnings, as serve does a worker file's.
func loadCluster(path string, e env, log *slog.Logger) (*config.Cluster, error) {
	envSnap := config.LoadEnv(e.lookup, e.environ)
	var f *config.File
	var err error
	if path == "" {
		f, err = config.LoadBytes("(embedded default cluster)", launch.DefaultCluster, envSnap)
	} else {
		f, err = config.LoadFile(path, envSnap)
	}
	if err != nil {
		return nil, err
	}
	if f.Kind != config.KindCluster {
		return nil, fmt.Errorf("%s is a worker file; this verb takes a cluster file (disagg_config.yaml with context_servers and generation_servers)", path)
	}
	for _, w := range f.Warnings {
		log.Warn(w.String())
	}
	return f.Cluster, nil
}

// httpListener is the worker's HTTP listener: the inherited socket of
// --listen-fd, else (0, the default) a new one on --host and --port.
func (sf *serveFlags) httpListener() (net.Listener, error) {
	if sf.listenFD == 0 {
		return net.Listen("tcp", net.JoinHostPort(sf.host, strconv.Itoa(sf.port)))
	}
	if sf.listenFD < 3 {
		return nil, fmt.Errorf("serve: --listen-fd %d: an inherited socket is fd 3 or above", sf.listenFD)
	}
	f := os.NewFile(uintptr(sf.listenFD), "listen-fd")
	defer f.Close()
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("serve: --listen-fd %d is not a listening socket: %w", sf.listenFD, err)
	}
	return ln, nil
}
