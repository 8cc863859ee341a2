package shm

import "errors"

// Errors of the shm backend, besides the transport errors it wraps.
var (
	// ErrNotShared: a Send's source is not inside a region registered with
	// RegisterMemory together with its memory file, so the receiver cannot
	// map it. Allocate sources with kvcache.ShmAllocator and register them.
	ErrNotShared = errors.New("shm: source memory is not in a shared-memory region registered with RegisterMemory")
	// ErrRefused: the receiver refused a Send, or stopped it, for a reason
	// of its own (no armed receipt under the descriptor's tag, the receipt
	// cancelled or being filled by another Send, a region it could not
	// map); the error text says which. A receipt cancelled by the receiver
	// also matches transport.ErrCanceled.
	ErrRefused = errors.New("shm: the receiver refused the transfer")
)
