package cli

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/kvxfer/kvxfer/internal/buildinfo"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/spf13/cobra"
)

func newVersionCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print the module version, VCS revision, Go version and the backends built in",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in := buildinfo.Read()
			var built []string
			for _, s := range transport.All() {
				if s.Available() {
					built = append(built, s.Name)
				}
			}
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(struct {
					buildinfo.Info
					Backends []string `json:"backends"`
				}{in, nonNil(built)})
			}
			rev := in.Revision
			if in.Modified {
				rev += " (modified)"
			}
			fmt.Fprintf(out, "kvxfer %s\nmodule:   %s\nrevision: %s\ngo:       %s %s\n", in.Version, in.Module, rev, in.GoVersion, in.Platform)
			if in.Tags != "" {
				fmt.Fprintf(out, "tags:     %s\n", in.Tags)
			}
			if len(built) == 0 {
				fmt.Fprintln(out, "backends: none available yet (see `kvxfer backends`)")
			} else {
				fmt.Fprintf(out, "backends: %s\n", strings.Join(built, ", "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print as JSON")
	return cmd
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
