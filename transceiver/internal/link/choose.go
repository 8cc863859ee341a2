package link

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transport"
)

// The choice of a pair's data plane: a pure function of what both ranks
// announced in their Hellos and, for shm, of whether this rank reaches the
// peer's shm endpoint (a probe Linker.Get runs once per control
// connection).

// shmAnswer is what is known of the probe of a peer's shm
// endpoint.
type shmAnswer struct {
	known bool  // the probe has been answered
	err   error // its answer: nil when shm is usable
}

// backendChoice is the outcome of chooseBackend: a backend, an error, or
// (probe) the need of the shm probe's answer before choosing.
type backendChoice struct {
	backend string
	probe   bool
	// passed is why shm was passed over for this peer (the probe's
	// answer), to log; nil when it was not.
	passed error
	err    error
}

// errNoCommonBackend: the two ranks have no data plane in common.
var errNoCommonBackend = errors.New("no backend in common")

// chooseBackend picks the data plane of the pair of this rank (its
// configured backend want, the backends mine it has open, on host) and
// peer: want itself unless it is "auto"; with AUTO, in the order auto,
// the first backend both have, where shm counts only with a peer on the
// same host whose shm endpoint this rank reaches.
func chooseBackend(want string, auto, mine []string, host string, peer control.Peer, shm shmAnswer) backendChoice {
	has := func(name string) bool { return slices.Contains(mine, name) && slices.Contains(peer.Backends, name) }
	if want != "auto" {
		if !has(want) {
			return backendChoice{err: fmt.Errorf("%w: backend %s: context rank %d at %s has %v open, this rank %v",
				transport.ErrNotBuilt, want, peer.Rank, peer.Endpoint, peer.Backends, mine)}
		}
		return backendChoice{backend: want}
	}
	var passed error
	for _, b := range auto {
		switch {
		case !has(b):
		case b != "shm":
			return backendChoice{backend: b, passed: passed}
		case peer.Host != host:
		case !shm.known:
			return backendChoice{probe: true}
		case shm.err == nil:
			return backendChoice{backend: b}
		default:
			passed = shm.err
		}
	}
	return backendChoice{passed: passed, err: fmt.Errorf("%w with context rank %d at %s (it has %v, this rank %v)",
		errNoCommonBackend, peer.Rank, peer.Endpoint, peer.Backends, mine)}
}
