package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/spf13/cobra"
)

func newBackendsCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "backends",
		Short: "List every transfer backend, whether this binary can use it, and why not",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "BACKEND\tAVAILABLE\tDETAIL")
			for _, s := range transport.All() {
				avail, detail := "yes", "built in"
				if s.Err != nil {
					avail, detail = "no", s.Err.Error()
				}
				if s.Name == config.BackendMPI.Lower() {
					detail += "; " + config.MPIWorldNote
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\n", strings.ToUpper(s.Name), avail, detail)
			}
			for _, b := range []config.Backend{config.BackendNIXL} {
				r := config.ResolveBackend(b, config.Env{}, nil)
				fmt.Fprintf(tw, "%s\tno\t%s\n", b, strings.TrimPrefix(r.Err.Error(), config.ErrBackendUnavailable.Error()+": "))
			}
			fmt.Fprintln(tw, "DEFAULT\t-\tresolved from TRTLLM_USE_{UCX,NIXL,MPI}_KVCACHE=1, else AUTO")
			fmt.Fprintln(tw, "AUTO\t-\tper peer: "+config.AutoRule)
			return tw.Flush()
		},
	}
}
