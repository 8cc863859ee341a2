//go:build ucx && cgo

package cli

// Builds with -tags ucx (and cgo, libucx-dev) get the UCX backend.
import _ "github.com/kvxfer/kvxfer/transport/ucx"
