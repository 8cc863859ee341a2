package engine

import (
	"errors"
	"fmt"
)

// Errors of the engine. Submit returns them wrapped with the details; a
// request that fails after Submit ends with a final event whose Err wraps
// one of them, a transceiver error or the client's context error.
var (
	// ErrClosed: the engine (or instance) was closed.
	ErrClosed = errors.New("engine: closed")
	// ErrBadConfig: a model or instance configuration is invalid.
	ErrBadConfig = errors.New("engine: bad config")
	// ErrBadRequest: a request is malformed (empty prompt, token out of the
	// vocabulary, missing context phase params, ...).
	ErrBadRequest = errors.New("engine: bad request")
	// ErrQueueFull: too many requests are waiting for admission.
	ErrQueueFull = errors.New("engine: queue full")
	// ErrTransfer: the KV-cache transfer of a generation_only request
	// failed; the transceiver's error is wrapped too.
	ErrTransfer = errors.New("engine: KV-cache transfer failed")
)

// TooLongError is returned by Submit for a request that could never fit in
// the KV cache, however long it waited.
type TooLongError struct {
	PromptTokens int // prompt length
	MaxTokens    int // tokens to generate (0 for context_only)
	NeedBlocks   int // blocks per rank the request needs
	PoolBlocks   int // blocks per rank the pool has
	BlockTokens  int // tokens per block
}

func (e *TooLongError) Error() string {
	return fmt.Sprintf("engine: request does not fit in the KV cache: prompt of %d tokens + %d to generate needs %d blocks per rank, the pool of each rank has %d (%d tokens)",
		e.PromptTokens, e.MaxTokens, e.NeedBlocks, e.PoolBlocks, e.PoolBlocks*e.BlockTokens)
}

// Unwrap makes errors.Is(err, ErrBadRequest) true.
func (e *TooLongError) Unwrap() error { return ErrBadRequest }
