//go:build !linux

package shm

import (
	"fmt"
	"runtime"

	"github.com/kvxfer/kvxfer/transport"
)

// The shm data plane needs Linux: memfd_create, abstract Unix sockets.
func init() {
	transport.RegisterUnavailable("shm", fmt.Errorf("%w: the shm backend needs Linux (this is %s)", transport.ErrNotBuilt, runtime.GOOS))
}
