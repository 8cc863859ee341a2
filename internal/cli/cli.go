package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	// The data planes register themselves.
	_ "github.com/kvxfer/kvxfer/transport/shm"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
)

// exitError carries an exit status through cobra without printing usage.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// env is how commands read the process environment; tests replace it.
type env struct {
	lookup  func(string) (string, bool)
	environ []string
}

// Run executes the kvxfer command line args and returns the exit status.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, stdout, stderr, env{lookup: os.LookupEnv, environ: os.Environ()})
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, e env) int {
	root := newRoot(e)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	default:
		fmt.Fprintln(stderr, "kvxfer:", err)
		return 2
	}
}

func newRoot(e env) *cobra.Command {
	root := &cobra.Command{
		Use:   "kvxfer",
		Short: "KV-cache transceiver for disaggregated LLM serving",
		Long: `kvxfer moves a prompt's KV cache from the context (prefill) instance that computed it
to the generation (decode) instance that continues it, with a configuration compatible
with TensorRT-LLM's cache_transceiver_config.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newVersionCmd(), newBackendsCmd(), newConfigCmd(e), newBenchCmd(e), newBenchPeerCmd(e), newClusterCmd(e),
		newServeCmd(e), newServeMPICmd(e), newRouterCmd(e), newUpCmd(e), newCertsCmd())
	return root
}
