package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/connect"
	"github.com/kvxfer/kvxfer/membership/memstore"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// isLoopback reports whether host (a name or an address; "" is every
// interface) can only be reached from this machine.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// routerMembership opens the membership of a disagg_cluster for the router
// listening on listenHost:listenPort: for an http(s):// cluster_uri the
// built-in store, which the router serves itself behind the cluster
// secret's token; for etcd:// a client of etcd. close releases it after
// the router closed.
//
// A built-in store without a cluster secret is refused unless both the
// cluster_uri and the listener are loopback: whoever can reach the store
// can register a worker, and the router would send it prompts.
func routerMembership(ctx context.Context, dc *config.DisaggCluster, secret []byte, etcd config.EtcdClient, listenHost string, listenPort int, log *slog.Logger) (*serve.ClusterOptions, func(), error) {
	co := &serve.ClusterOptions{Name: dc.ClusterName, MinContext: dc.MinContext, MinGeneration: dc.MinGeneration, URI: dc.ClusterURI}
	if !connect.IsBuiltIn(*dc) {
		st, err := connect.Open(ctx, *dc, connect.Options{EtcdClient: etcd})
		if err != nil {
			return nil, nil, fmt.Errorf("disagg_cluster: %w", err)
		}
		co.Store = st
		log.Info("cluster membership: etcd", "cluster_uri", dc.ClusterURI, "cluster_name", dc.ClusterName,
			"minimal_instances", fmt.Sprintf("context %d, generation %d", dc.MinContext, dc.MinGeneration))
		return co, func() { st.Close() }, nil
	}
	u, err := config.ParseClusterURI(dc.ClusterURI)
	if err != nil {
		return nil, nil, fmt.Errorf("disagg_cluster.cluster_uri: %w", err)
	}
	uriHost, uriPort, _ := net.SplitHostPort(u.Endpoints[0])
	if len(secret) == 0 && (!isLoopback(uriHost) || !isLoopback(listenHost)) {
		return nil, nil, fmt.Errorf("disagg_cluster: the built-in store (cluster_uri %s) on a non-loopback address needs a cluster secret: "+
			"without one, anyone who reaches the router could register a worker and receive prompts; set security.secret_file or "+
			"%s (the router and every worker), use etcd://, or keep the router and cluster_uri on 127.0.0.1", dc.ClusterURI, config.EnvClusterSecret)
	}
	if uriPort != fmt.Sprint(listenPort) && listenPort != 0 {
		log.Warn("disagg_cluster: cluster_uri names another port than the router listens on: workers register at the cluster_uri",
			"cluster_uri", dc.ClusterURI, "router_port", listenPort)
	}
	st := memstore.New(memstore.Options{})
	co.Store = st
	co.Handler = memstore.Handler(st, memstore.HandlerOptions{Token: connect.Token(secret)})
	if len(secret) == 0 {
		// Whoever reaches the store unauthenticated (any local process,
		// or anyone through a proxy in front of the router) registers:
		// like a worker without a secret, the router then sends requests
		// only to loopback.
		co.Accept = loopbackMember
	}
	log.Info("cluster membership: the router serves the built-in store", "cluster_uri", dc.ClusterURI, "path", memstore.BasePath,
		"cluster_name", dc.ClusterName, "token", len(secret) > 0,
		"minimal_instances", fmt.Sprintf("context %d, generation %d", dc.MinContext, dc.MinGeneration))
	return co, func() { st.Close() }, nil
}

// loopbackMember accepts a record whose URL's host is a loopback address
// or localhost (a name is not resolved: it could resolve elsewhere later).
func loopbackMember(rec *membership.Record) error {
	u, err := url.Parse(rec.URL)
	if err != nil {
		return err
	}
	if !isLoopback(u.Hostname()) {
		return fmt.Errorf("the built-in store has no cluster secret: the router routes only to loopback workers, not %s "+
			"(set a cluster secret on the router and the workers to register others)", u.Hostname())
	}
	return nil
}

func newClusterCmd(e env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "Inspect a disagg_cluster membership (workers that register themselves)",
		Args:  cobra.NoArgs,
	}
	var uri, name string
	var timeout time.Duration
	var etcd config.EtcdClient
	status := &cobra.Command{
		Use:   "status",
		Short: "List the workers registered in a cluster: role, URL, model, layout, backends, age",
		Long: `status lists every worker registered under the cluster's name in the store of --uri
(etcd://host:port[,host:port] or http://router-host:port, the router's built-in store). The
built-in store's token comes from the cluster secret (security.secret_* of the cluster file is
not read here: set KVXFER_CLUSTER_SECRET). An etcd with TLS or authentication takes the --etcd-*
flags, the keys of a file's security.etcd block.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if uri == "" {
				return errors.New("--uri is required (etcd://host:port or http://router-host:port)")
			}
			if err := config.CheckClusterName(name); err != nil {
				return fmt.Errorf("--cluster: %w", err)
			}
			envSnap := config.LoadEnv(e.lookup, e.environ)
			sec, err := config.SecurityFromEnv(envSnap)
			if err != nil {
				return err
			}
			secret, _, err := sec.LoadSecret(envSnap)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			if (etcd.CertFile == "") != (etcd.KeyFile == "") {
				return errors.New("--etcd-cert-file and --etcd-key-file go together")
			}
			if (etcd.Username == "") != (etcd.PasswordFile == "") {
				return errors.New("--etcd-user and --etcd-password-file go together")
			}
			st, err := connect.Open(ctx, config.DisaggCluster{ClusterURI: uri, ClusterName: name},
				connect.Options{Token: connect.Token(secret), EtcdClient: etcd})
			if err != nil {
				return err
			}
			defer st.Close()
			ws, bad, err := membership.ListWorkers(ctx, st, name)
			if err != nil {
				return err
			}
			printMembers(cmd, ws, bad, time.Now())
			return nil
		},
	}
	status.Flags().StringVar(&uri, "uri", "", "cluster_uri: etcd://host:port[,host:port] or http://router-host:port")
	status.Flags().StringVar(&name, "cluster", "", "cluster_name")
	status.Flags().DurationVar(&timeout, "timeout", 10*time.Second, "deadline of the whole listing")
	status.Flags().StringVar(&etcd.CAFile, "etcd-ca-file", "", "etcd over TLS: PEM CAs of etcd's server certificate (security.etcd.ca_file)")
	status.Flags().StringVar(&etcd.CertFile, "etcd-cert-file", "", "etcd over TLS: client certificate (security.etcd.cert_file)")
	status.Flags().StringVar(&etcd.KeyFile, "etcd-key-file", "", "etcd over TLS: the client certificate's key (security.etcd.key_file)")
	status.Flags().StringVar(&etcd.Username, "etcd-user", "", "etcd authentication: user (security.etcd.username)")
	status.Flags().StringVar(&etcd.PasswordFile, "etcd-password-file", "", "etcd authentication: file holding the user's password (security.etcd.password_file)")
	cmd.AddCommand(status)
	return cmd
}

// printMembers writes the members as a table.
func printMembers(cmd *cobra.Command, ws []membership.WorkerInfo, bad int, now time.Time) {
	w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ROLE\tURL\tMODEL\tTP/PP/DP\tLAYOUT\tBACKENDS\tAGE\tMEMBER")
	for _, m := range ws {
		r := m.Record
		age := "-"
		if !r.RegisteredAt.IsZero() {
			age = now.Sub(r.RegisteredAt).Round(time.Second).String()
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d/%d/%d\t%s\t%s\t%s\t%s\n", r.Role, r.URL, r.Model, r.Layout.TP, r.Layout.PP, r.Layout.DP,
			r.LayoutFingerprint, strings.Join(r.Backends, ","), age, m.ID)
	}
	w.Flush()
	fmt.Fprintf(cmd.OutOrStdout(), "%d workers", len(ws))
	if bad > 0 {
		fmt.Fprintf(cmd.OutOrStdout(), " (%d records that did not decode left out)", bad)
	}
	fmt.Fprintln(cmd.OutOrStdout())
}
