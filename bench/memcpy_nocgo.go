//go:build !cgo

package bench

import "errors"

// cMemcpy is not available in a binary built without cgo.
func cMemcpy(dst, src []byte) error {
	return errors.New("not measured: this binary was built without cgo")
}
