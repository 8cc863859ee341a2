//go:build chaos

package cli

import (
	"os"

	"github.com/kvxfer/kvxfer/transport/faultinject"
)

// kvxfer built with -tags chaos (the chaos suite's binary, tests/chaos):
// a worker's data planes get the faults that KVXFER_FAULTS plans
// (faultinject.ParsePlan). Other binaries do not contain faultinject.
func init() { dataPlaneFaults = func() (wrapFunc, error) { return faultinject.FromEnv(os.Getenv) } }
