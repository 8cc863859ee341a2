//go:build !ucx || !cgo

package transport

import "fmt"

// Without the build tag ucx (or without cgo, which the UCX binding needs)
// the backend is listed with the reason; with both, package transport/ucx
// registers the real one when the binary imports it.
func init() {
	RegisterUnavailable("ucx", fmt.Errorf("%w: build with -tags ucx (needs libucx-dev)", ErrNotBuilt))
}
