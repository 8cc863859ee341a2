// Command kvxfer is the KV-cache transceiver's command line: see
// `kvxfer --help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvxfer/kvxfer/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
