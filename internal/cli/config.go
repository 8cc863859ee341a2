package cli

import (
	"fmt"
	"io"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/spf13/cobra"
)

func newConfigCmd(e env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Work with kvxfer / TensorRT-LLM config files",
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "check FILE...",
		Short: "Validate worker and cluster config files and print the effective config with each value's source",
		Long: `check loads each FILE in the order defaults -> YAML -> environment -> validation and
prints the effective configuration, where every value came from (default, file:line:col,
env), the backend that DEFAULT resolves to and why, every warning and every error.
A file with context_servers or generation_servers is a cluster file (disagg_config.yaml);
any other is a worker file (extra LLM API options). Exit status 0 when every file is
valid, 1 otherwise.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, files []string) error {
			envSnap := config.LoadEnv(e.lookup, e.environ)
			bad := 0
			for i, path := range files {
				if i > 0 {
					fmt.Fprintln(cmd.OutOrStdout())
				}
				if !checkOne(cmd.OutOrStdout(), cmd.ErrOrStderr(), path, envSnap) {
					bad++
				}
			}
			if bad > 0 {
				return exitError{1}
			}
			return nil
		},
	})
	return cmd
}

// checkOne prints the report of one file and reports whether it is valid.
func checkOne(out, errw io.Writer, path string, env config.Env) bool {
	f, err := config.LoadFile(path, env)
	if f == nil {
		fmt.Fprintf(out, "# %s: invalid\n", path)
		printErrors(errw, err)
		return false
	}
	status := "valid"
	if err != nil {
		status = "invalid"
	}
	fmt.Fprintf(out, "# %s: %s file, %s\n", path, f.Kind, status)
	if ferr := f.Format(out); ferr != nil {
		fmt.Fprintf(errw, "error: %v\n", ferr)
		return false
	}
	for _, nt := range f.Transceivers() {
		r := nt.CT.Resolve(transceiver.Availability)
		fmt.Fprintf(out, "# %s: %s → %s: %s\n", nt.Path+".backend", r.Configured, r.Backend, r.Reason)
		for _, ig := range r.Ignored {
			fmt.Fprintf(out, "#   env %s\n", ig)
		}
		if r.Err != nil && err == nil {
			// A valid config whose backend this binary cannot run (UCX
			// without -tags ucx, say) is the binary's problem, not the
			// file's: say so, but do not fail the check.
			fmt.Fprintf(out, "#   note: in this binary: %v\n", r.Err)
		}
	}
	var sec *config.Security
	if f.Kind == config.KindWorker {
		sec = &f.Worker.Security
	} else {
		sec = &f.Cluster.Security
	}
	// Where the secret is and how long it is; never the secret.
	switch secret, src, serr := sec.LoadSecret(env); {
	case serr != nil:
		fmt.Fprintf(out, "# security: note: the cluster secret cannot be loaded here: %v\n", serr)
	case secret == nil:
		fmt.Fprintf(out, "# security: no cluster secret (%s is unset): unauthenticated, peers limited to loopback and allowed_peer_hosts (kvxfer up generates one)\n", config.EnvClusterSecret)
	default:
		fmt.Fprintf(out, "# security: cluster secret from %s (%d bytes)\n", src, len(secret))
	}
	if f.Kind == config.KindWorker && f.Worker.CacheTransceiver == nil {
		fmt.Fprintf(out, "# no cache_transceiver_config: this worker cannot serve disaggregated requests\n")
	}
	for _, w := range f.Warnings {
		fmt.Fprintf(errw, "warning: %s\n", w)
	}
	if err != nil {
		printErrors(errw, err)
		return false
	}
	return true
}

func printErrors(w io.Writer, err error) {
	if ps, ok := err.(config.Problems); ok {
		for _, p := range ps {
			fmt.Fprintf(w, "error: %s\n", p)
		}
		return
	}
	fmt.Fprintf(w, "error: %v\n", err)
}
