package shm

import "errors"

// Errors of the shm backend, besides the transport errors it wraps.
var (
	// ErrRefused: the receiver refused a Send, or stopped it, for a reason
	// of its own (no armed receipt under the descriptor's tag, the receipt
	// cancelled or being filled by another Send, a window it could not
	// map); the error text says which. A receipt cancelled by the receiver
	// also matches transport.ErrCanceled.
	ErrRefused = errors.New("shm: the receiver refused the transfer")
)
