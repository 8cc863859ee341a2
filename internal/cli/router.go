package cli

import (
	"errors"
	"fmt"
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

func newRouterCmd(e env) *cobra.Command {
	var (
		cfgPath, host string
		port          int
		lf            logFlags
		admin         adminFlag
		tf            tlsFlags
		hf            httpFlags
		df            deadlineFlags
		mf            migrationFlag
	)
	cmd := &cobra.Command{
		Use:   "router",
		Short: "Run the disaggregated router in front of running workers (cluster file with urls, or disagg_cluster)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := lf.logger(cmd)
			if err != nil {
				return err
			}
			if cfgPath == "" {
				return errors.New("--config: a cluster file with context_servers.urls and generation_servers.urls, or disagg_cluster, is required")
			}
			cl, err := loadCluster(cfgPath, e, log)
			if err != nil {
				return err
			}
			if err := routable(cl); err != nil {
				return fmt.Errorf("%s: %w", cfgPath, err)
			}
			tc, err := tf.loadOr(cl.Security.TLS)
			if err != nil {
				return err
			}
			ro := serve.ClusterRouting(cl)
			ro.Logger, ro.RouterDeadlines, ro.MigrationLimit = log, serve.RouterDeadlines(df), mf.limit()
			// The cluster secret, when there is one, also proves the router
			// to the workers' KV cache event and cached-prefix routes.
			secret, err := loadSecret(&cl.Security, config.LoadEnv(e.lookup, e.environ), log)
			if err != nil {
				return err
			}
			ro.Secret = secret
			if tc != nil {
				ro.TLS = tc.Client
			}
			if host == "" {
				host = cl.Hostname
			}
			if !cmd.Flags().Changed("port") {
				port = cl.Port
			}
			if dc := cl.DisaggCluster; dc != nil {
				co, closeStore, err := routerMembership(cmd.Context(), dc, secret, cl.Security.Etcd, host, port, log)
				if err != nil {
					return fmt.Errorf("%s: %w", cfgPath, err)
				}
				defer closeStore()
				ro.Cluster = co
			}
			r, err := serve.NewRouter(ro)
			if err != nil {
				return err
			}
			defer r.Close()
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
			log.Info("router listening", "url", "http://"+ln.Addr().String(), "context", cl.Context.URLs, "generation", cl.Generation.URLs,
				"migration_limit", r.MigrationLimit())
			return serveHTTP(cmd.Context(), ln, serve.NewHTTPServer(r.Handler(), hf.lim), log)
		},
	}
	cmd.Flags().StringVar(&cfgPath, "config", "", "cluster file (disagg_config.yaml)")
	cmd.Flags().StringVar(&host, "host", "", "listen host (default: the file's hostname)")
	cmd.Flags().IntVar(&port, "port", config.DefaultPort, "listen port (default: the file's port)")
	tf.add(cmd, "to the workers (the router's own listener stays plain HTTP)")
	lf.add(cmd)
	admin.add(cmd)
	hf.add(cmd)
	df.add(cmd)
	mf.add(cmd)
	return cmd
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
