package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// routable reports why the router cannot route for cl, or nil.
func routable(cl *config.Cluster) error {
	switch {
	case cl.Context.NumInstances == 0 && cl.DisaggCluster == nil:
		return errors.New("context_servers.num_instances is 0, TensorRT-LLM's generation-only benchmark mode, which kvxfer router " +
			"does not support yet: it sends every request to a context worker first")
	case len(cl.Context.URLs) > 0 && len(cl.Generation.URLs) > 0, cl.DisaggCluster != nil:
		return nil
	}
	return errors.New("the router needs context_servers.urls and generation_servers.urls (kvxfer up starts workers and picks ports itself)")
}

// routerFlags are kvxfer router's flags.
type routerFlags struct {
	cfgPath, host string
	port          int
	lf            logFlags
	admin         adminFlag
	tf            tlsFlags
	hf            httpFlags
	df            deadlineFlags
	mf            migrationFlag
}

func newRouterCmd(e env) *cobra.Command {
	var rf routerFlags
	cmd := &cobra.Command{
		Use:   "router",
		Short: "Run the disaggregated router in front of running workers (cluster file with urls, or disagg_cluster)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return rf.run(cmd, e)
		},
	}
	cmd.Flags().StringVar(&rf.cfgPath, "config", "", "cluster file (disagg_config.yaml)")
	cmd.Flags().StringVar(&rf.host, "host", "", "listen host (default: the file's hostname)")
	cmd.Flags().IntVar(&rf.port, "port", config.DefaultPort, "listen port (default: the file's port)")
	rf.tf.add(cmd, "to the workers (the router's own listener stays plain HTTP)")
	rf.lf.add(cmd)
	rf.admin.add(cmd)
	rf.hf.add(cmd)
	rf.df.add(cmd)
	rf.mf.add(cmd)
	return cmd
}

// run is kvxfer router: it routes for the cluster of --config until the
// command's context ends.
func (rf *routerFlags) run(cmd *cobra.Command, e env) error {
	log, err := rf.lf.logger(cmd)
	if err != nil {
		return err
	}
	cl, err := rf.cluster(e, log)
	if err != nil {
		return err
	}
	ro, err := rf.options(cl, e, log)
	if err != nil {
		return err
	}
	if rf.host == "" {
		rf.host = cl.Hostname
	}
	if !cmd.Flags().Changed("port") {
		rf.port = cl.Port
	}
	var endPolls func() // the built-in store's Close, nil for etcd or none
	if dc := cl.DisaggCluster; dc != nil {
		co, closeStore, err := routerMembership(cmd.Context(), dc, ro.Secret, cl.Security.Etcd, rf.host, rf.port, log)
		if err != nil {
			return fmt.Errorf("%s: %w", rf.cfgPath, err)
		}
		defer closeStore()
		if co.Handler != nil {
			endPolls = closeStore
		}
		ro.Cluster = co
	}
	r, err := serve.NewRouter(ro)
	if err != nil {
		return err
	}
	defer r.Close()
	return rf.listenAndServe(cmd, r, cl, log, endPolls)
}

// cluster is the cluster file of --config, checked to be one the router
// can route for.
func (rf *routerFlags) cluster(e env, log *slog.Logger) (*config.Cluster, error) {
	if rf.cfgPath == "" {
		return nil, errors.New("--config: a cluster file with context_servers.urls and generation_servers.urls, or disagg_cluster, is required")
	}
	cl, err := loadCluster(rf.cfgPath, e, log)
	if err != nil {
		return nil, err
	}
	if err := routable(cl); err != nil {
		return nil, fmt.Errorf("%s: %w", rf.cfgPath, err)
	}
	return cl, nil
}

// options are the router's options for cl and the flags: routing,
// deadlines, the migration limit, the cluster secret and the workers' TLS.
func (rf *routerFlags) options(cl *config.Cluster, e env, log *slog.Logger) (serve.RouterOptions, error) {
	tc, err := rf.tf.loadOr(cl.Security.TLS)
	if err != nil {
		return serve.RouterOptions{}, err
	}
	ro := serve.ClusterRouting(cl)
	ro.Logger, ro.RouterDeadlines, ro.MigrationLimit = log, serve.RouterDeadlines(rf.df), rf.mf.limit()
	// The cluster secret, when there is one, also proves the router
	// to the workers' KV cache event and cached-prefix routes.
	secret, err := loadSecret(&cl.Security, config.LoadEnv(e.lookup, e.environ), log)
	if err != nil {
		return serve.RouterOptions{}, err
	}
	ro.Secret = secret
	if tc != nil {
		ro.TLS = tc.Client
	}
	return ro, nil
}

// listenAndServe serves r's HTTP API on the listen address, and the admin
// endpoint when asked, until the command's context ends; endPolls (the
// built-in store's Close; nil without one) runs as the stop begins, so
// that the store's long polls end at once instead of holding the stop.
func (rf *routerFlags) listenAndServe(cmd *cobra.Command, r *serve.Router, cl *config.Cluster, log *slog.Logger, endPolls func()) error {
	ln, err := net.Listen("tcp", net.JoinHostPort(rf.host, strconv.Itoa(rf.port)))
	if err != nil {
		return err
	}
	log.Info("listening", "plane", "http", "addr", ln.Addr().String(), "limits", rf.hf.lim.WithDefaults())
	ln = serve.LimitListener(ln, "router http", rf.hf.lim, log, metrics.NewConns(r.Registry()))
	wait, err := rf.admin.start(cmd.Context(), log)
	if err != nil {
		return err
	}
	defer wait()
	log.Info("router listening", "url", "http://"+ln.Addr().String(), "context", cl.Context.URLs, "generation", cl.Generation.URLs,
		"migration_limit", r.MigrationLimit())
	return serveHTTP(cmd.Context(), ln, serve.NewHTTPServer(r.Handler(), rf.hf.lim), log, endPolls)
}

// deadlineFlags are the router's per-phase deadlines, for kvxfer router
// and for the router kvxfer up starts.
type deadlineFlags serve.RouterDeadlines

func (d *deadlineFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.DurationVar(&d.HeaderTimeout, "header-timeout", serve.DefaultHeaderTimeout,
		"longest wait for a worker's response headers (a context worker sends them after the prefill); a worker that misses it is marked down")
	f.DurationVar(&d.ChunkTimeout, "chunk-timeout", serve.DefaultChunkTimeout,
		"longest wait for data in a worker's answer (the gap between two stream chunks); a worker that misses it is marked down")
	f.DurationVar(&d.HealthTimeout, "health-timeout", serve.DefaultHealthTimeout, "deadline of each worker's health probe (the router's /health, and the probes of workers marked down)")
	f.DurationVar(&d.ProbeInterval, "probe-interval", serve.DefaultProbeInterval, "how often a worker marked down is probed until it answers")
}

// migrationFlag is --migration-limit, for kvxfer router and for the router
// kvxfer up starts.
type migrationFlag int

func (m *migrationFlag) add(cmd *cobra.Command) {
	cmd.Flags().IntVar((*int)(m), "migration-limit", serve.DefaultMigrationLimit,
		"how many times one request may migrate to another generation worker when its generation worker dies or fails mid-request "+
			"(the client's stream continues where it was cut); 0 turns migration off: the client gets an error event")
}

// limit is the flag as serve.RouterOptions.MigrationLimit: 0 there means
// the default, off is serve.MigrationOff.
func (m migrationFlag) limit() int {
	if m <= 0 {
		return serve.MigrationOff
	}
	return int(m)
}
