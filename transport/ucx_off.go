//go:build !ucx

package transport

import "fmt"

func init() {
	RegisterUnavailable("ucx", fmt.Errorf("%w: build with -tags ucx (needs libucx-dev)", ErrNotBuilt))
}
