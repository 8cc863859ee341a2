package transceiver

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

// TestRequestErr: a request failed by a data connection's loss matches
// ErrPeerLost, as one failed by the control connection's does; other
// failures are left as they are.
func TestRequestErr(t *testing.T) {
	data := fmt.Errorf("receive from context rank 0: %w", transport.ErrPeerLost)
	if err := requestErr(data); !errors.Is(err, ErrPeerLost) || !errors.Is(err, transport.ErrPeerLost) {
		t.Errorf("data connection lost: %v matches ErrPeerLost %v, transport.ErrPeerLost %v",
			err, errors.Is(err, ErrPeerLost), errors.Is(err, transport.ErrPeerLost))
	}
	for _, err := range []error{
		fmt.Errorf("%w: control connection to x: EOF", ErrPeerLost),
		fmt.Errorf("%w: request 1", ErrTimeout),
		nil,
	} {
		if got := requestErr(err); got != err {
			t.Errorf("requestErr(%v) = %v, want it unchanged", err, got)
		}
	}
}
