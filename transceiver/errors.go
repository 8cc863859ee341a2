package transceiver

import (
	"errors"
	"fmt"

	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// Errors of the transceiver. Failures of a request wrap one of these (or a
// transport error) with the request id, the peer and what was going on.
var (
	// ErrRefused: the context rank refused the request-info (unknown or
	// expired request, wrong token, incompatible layouts). The reason
	// follows in the message.
	ErrRefused = control.ErrRefused
	// ErrPeerAborted: the peer ended the transfer with an error.
	ErrPeerAborted = errors.New("transceiver: aborted by peer")
	// ErrTimeout: kv_transfer_timeout_ms passed before the transfer ended.
	ErrTimeout = errors.New("transceiver: transfer timed out")
	// ErrCanceled: the request was cancelled locally.
	ErrCanceled = errors.New("transceiver: transfer cancelled")
	// ErrClosed: the transceiver was closed.
	ErrClosed = control.ErrClosed
	// ErrBadOpaqueState: the opaque state does not decode.
	ErrBadOpaqueState = errors.New("transceiver: bad opaque state")
	// ErrNoTransceiver: the worker has no cache_transceiver_config.
	ErrNoTransceiver = errors.New("transceiver: not configured")
	// ErrPromptMismatch: a generation request's prompt is not the one its
	// context request's KV cache was computed for.
	ErrPromptMismatch = errors.New("transceiver: prompt does not match the context request")
	// ErrPeerLost: a connection to the peer broke, the control connection
	// or a data connection (the failure then wraps transport.ErrPeerLost
	// too).
	ErrPeerLost = control.ErrPeerLost
	// ErrTooManyAttempts: a context request ended because maxPullAttempts
	// pulls of it failed (each for a reason of the generation side or the
	// link).
	ErrTooManyAttempts = errors.New("transceiver: too many failed pull attempts")

	// Refusals of an opaque state by a generation instance, before it dials
	// anything (see CheckOpaque).

	// ErrUnsignedOpaqueState: the instance has a cluster secret and the
	// state is not signed.
	ErrUnsignedOpaqueState = errors.New("transceiver: unsigned opaque state")
	// ErrForgedOpaqueState: the state's MAC does not match its content
	// under this instance's cluster secret (a field was changed, or the
	// context instance has another secret).
	ErrForgedOpaqueState = errors.New("transceiver: forged opaque state")
	// ErrExpiredOpaqueState: the state's expiry has passed; the context
	// instance has released the request's blocks.
	ErrExpiredOpaqueState = errors.New("transceiver: expired opaque state")
	// ErrReplayedOpaqueState: this instance has already accepted a state
	// with the same nonce.
	ErrReplayedOpaqueState = errors.New("transceiver: replayed opaque state")
	// ErrReplayCacheFull: the instance holds as many unexpired nonces as
	// Options.NonceCacheSize allows; new signed states are refused until
	// some expire.
	ErrReplayCacheFull = errors.New("transceiver: too many opaque states in flight (nonce cache full)")
	// ErrPeerNotAllowed: a peer host is neither loopback nor on the
	// allow-list (or, without a secret, not loopback and not allowed).
	ErrPeerNotAllowed = errors.New("transceiver: peer not allowed")
	// ErrStalled: a staged transfer held a shared staging buffer past
	// ConnLimits.StagingHold while another transfer waited for one (its
	// peer stopped reading or sending); the pull attempt fails, and a
	// context request stays pullable.
	ErrStalled = errors.New("transceiver: peer stalled")
	// ErrInvalidRequest: RespondAndSendAsync or RequestAndReceiveAsync was
	// handed a request the caller got wrong (its type, its blocks per
	// rank, its DP rank, no opaque state, an id already in flight on that
	// side); nothing was started. The message says what is wrong.
	ErrInvalidRequest = errors.New("transceiver: invalid request")
)

// invalidRequest returns an error with the formatted text that wraps
// ErrInvalidRequest (without repeating its text).
func invalidRequest(format string, args ...any) error {
	return &invalidErr{msg: fmt.Sprintf(format, args...)}
}

type invalidErr struct{ msg string }

func (e *invalidErr) Error() string { return e.msg }
func (e *invalidErr) Unwrap() error { return ErrInvalidRequest }

// requestErr is err as a request's failure: a data connection's loss
// (transport.ErrPeerLost) is the peer's loss, ErrPeerLost, as the control
// connection's is, so that callers test one error whichever connection
// saw it first.
func requestErr(err error) error {
	if errors.Is(err, transport.ErrPeerLost) && !errors.Is(err, ErrPeerLost) {
		return fmt.Errorf("%w: %w", ErrPeerLost, err)
	}
	return err
}

// peerCaused reports whether a failure of a pull is the generation side's
// or the link's, not the context side's own: a lost connection (control or
// data), an abort by the peer, a peer that broke the protocol (a malformed
// frame, a bad descriptor). Such a failure fails the pull attempt, and the
// context request stays pullable (see sendCore); any other fails the
// context request.
func peerCaused(err error) bool {
	for _, e := range []error{ErrPeerLost, transport.ErrPeerLost, ErrPeerAborted, ErrStalled, wire.ErrMalformed, transport.ErrBadDescriptor, transport.ErrProtocol} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
