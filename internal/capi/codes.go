package capi

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
)

// Code is a result code of the C ABI. The values are those of
// kvxfer_status in include/kvxfer.h (ABI version 1) and never change
// meaning; TestCodesMatchHeader holds the two in step.
type Code int32

// The result codes.
const (
	OK                  Code = 0
	CodeInvalidArgument Code = 1  // a NULL, negative or inconsistent argument
	CodeConfig          Code = 2  // the config is invalid (the message is config check's)
	CodeBadHandle       Code = 3  // the handle is 0, closed or of another kind
	CodeBufferTooSmall  Code = 4  // a caller buffer is too small; the size needed is returned
	CodeBadOpaqueState  Code = 5  // an opaque state that does not decode, or is refused
	CodeIncompatible    Code = 6  // the two instances' cache states cannot be paired
	CodeTimeout         Code = 7  // a wait or a transfer ran out of time
	CodeCanceled        Code = 8  // the request was cancelled
	CodePeer            Code = 9  // the peer refused, aborted or was lost
	CodeClosed          Code = 10 // the transceiver is closed
	CodeInFlight        Code = 11 // a request with this id is already in flight on this side
	CodeForked          Code = 12 // called in a forked child of the process that loaded the library
	CodeTransfer        Code = 13 // a transfer failed for another reason
	CodeNotFound        Code = 14 // no request with this id
	CodeInternal        Code = 15 // a bug of kvxfer (the message says what)
	CodeUnsupported     Code = 16 // not supported in this build or ABI version
	CodeGroup           Code = 17 // the instance's group of processes: not joined yet, lost, or bad
)

var codeNames = map[Code]string{
	OK: "KVXFER_OK", CodeInvalidArgument: "KVXFER_ERR_INVALID_ARGUMENT", CodeConfig: "KVXFER_ERR_CONFIG",
	CodeBadHandle: "KVXFER_ERR_BAD_HANDLE", CodeBufferTooSmall: "KVXFER_ERR_BUFFER_TOO_SMALL",
	CodeBadOpaqueState: "KVXFER_ERR_BAD_OPAQUE_STATE", CodeIncompatible: "KVXFER_ERR_INCOMPATIBLE",
	CodeTimeout: "KVXFER_ERR_TIMEOUT", CodeCanceled: "KVXFER_ERR_CANCELED", CodePeer: "KVXFER_ERR_PEER",
	CodeClosed: "KVXFER_ERR_CLOSED", CodeInFlight: "KVXFER_ERR_IN_FLIGHT", CodeForked: "KVXFER_ERR_FORKED",
	CodeTransfer: "KVXFER_ERR_TRANSFER", CodeNotFound: "KVXFER_ERR_NOT_FOUND", CodeInternal: "KVXFER_ERR_INTERNAL",
	CodeUnsupported: "KVXFER_ERR_UNSUPPORTED", CodeGroup: "KVXFER_ERR_GROUP",
}

// String returns the header's name of c.
func (c Code) String() string {
	if n, ok := codeNames[c]; ok {
		return n
	}
	return fmt.Sprintf("kvxfer_status(%d)", int32(c))
}

// Codes lists every code, in value order.
func Codes() []Code {
	out := make([]Code, 0, len(codeNames))
	for c := OK; int(c) < len(codeNames); c++ {
		out = append(out, c)
	}
	return out
}

// Error is an error with the code the C ABI returns for it.
type Error struct {
	Code Code
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// Sentinels of this package.
var (
	// ErrBadHandle is returned for a handle that names nothing (0, closed,
	// or of another kind).
	ErrBadHandle = errors.New("capi: bad handle")
	// ErrNotFound is returned for a request id that no call knows.
	ErrNotFound = errors.New("capi: no such request")
	// ErrInvalidArgument is wrapped by every refusal of an argument.
	ErrInvalidArgument = errors.New("capi: invalid argument")
	// ErrInFlight is returned for a request id already in flight on the
	// same side.
	ErrInFlight = errors.New("capi: request already in flight")
)

func errorf(c Code, format string, args ...any) error {
	return &Error{Code: c, Err: fmt.Errorf(format, args...)}
}

// CodeOf returns the code the C ABI reports for err (OK for nil).
func CodeOf(err error) Code {
	var ce *Error
	var inc *layout.IncompatibleError
	switch {
	case err == nil:
		return OK
	case errors.As(err, &ce):
		return ce.Code
	case errors.Is(err, config.ErrInvalid), errors.Is(err, config.ErrNoSecret), errors.Is(err, transceiver.ErrNoTransceiver):
		return CodeConfig
	case errors.Is(err, ErrBadHandle):
		return CodeBadHandle
	case errors.Is(err, ErrNotFound):
		return CodeNotFound
	case errors.Is(err, ErrInvalidArgument), errors.Is(err, transceiver.ErrInvalidRequest), errors.Is(err, kvcache.ErrBadBlock):
		return CodeInvalidArgument
	case errors.Is(err, ErrInFlight):
		return CodeInFlight
	case errors.As(err, &inc):
		return CodeIncompatible
	case errors.Is(err, transceiver.ErrBadOpaqueState), errors.Is(err, transceiver.ErrUnsignedOpaqueState),
		errors.Is(err, transceiver.ErrForgedOpaqueState), errors.Is(err, transceiver.ErrExpiredOpaqueState),
		errors.Is(err, transceiver.ErrReplayedOpaqueState), errors.Is(err, transceiver.ErrPeerNotAllowed),
		errors.Is(err, transceiver.ErrPromptMismatch):
		return CodeBadOpaqueState
	case errors.Is(err, transceiver.ErrGroupLost), errors.Is(err, transceiver.ErrNotJoined), errors.Is(err, transceiver.ErrBadGroup):
		return CodeGroup
	case errors.Is(err, transceiver.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return CodeTimeout
	case errors.Is(err, transceiver.ErrCanceled), errors.Is(err, context.Canceled):
		return CodeCanceled
	case errors.Is(err, transceiver.ErrClosed):
		return CodeClosed
	case errors.Is(err, transceiver.ErrRefused), errors.Is(err, transceiver.ErrPeerAborted),
		errors.Is(err, transceiver.ErrPeerLost), errors.Is(err, transceiver.ErrTooManyAttempts), errors.Is(err, transceiver.ErrStalled):
		return CodePeer
	case errors.Is(err, errors.ErrUnsupported):
		return CodeUnsupported
	}
	return CodeTransfer
}
