package transport

import "fmt"

// The shared-memory data plane is not written yet; until it is, the name is
// listed with the reason.
func init() {
	RegisterUnavailable("shm", fmt.Errorf("%w: the shared-memory data plane arrives after the TCP one", ErrNotImplemented))
}
