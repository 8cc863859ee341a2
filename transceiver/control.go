package transceiver

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// What the rank tells of itself on its control connections, and how it
// picks a pair's backend from what the peer tells: the policy is
// chooseBackend's (backend.go); the probe of a peer's shm endpoint it may
// need runs here, once per connection. The connections themselves are
// internal/control's.

// hello is what the rank tells of itself when a control connection opens,
// in either direction: its data planes' endpoints in the order of their
// names.
func (r *rank) hello() wire.Hello {
	st, _ := r.state.MarshalBinary()
	eps := make([]string, len(r.names))
	for i, n := range r.names {
		eps[i] = r.transports[n].Endpoint()
	}
	return wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.names, Endpoints: eps}
}

// pickBackend picks the data plane for the pair over cc (chooseBackend),
// probing the peer's shm endpoint when the choice needs it; unless
// mayWait, it reports ok false instead of waiting for a probe that has not
// been answered yet.
func (r *rank) pickBackend(cc *control.Conn, mayWait bool) (backend string, ok bool, err error) {
	peer := cc.Peer()
	probeErr, known := cc.Probed()
	c := chooseBackend(r.set.backend, r.names, r.set.host, peer, shmAnswer{known: known, err: probeErr})
	if c.probe {
		if !mayWait {
			return "", false, nil
		}
		c = chooseBackend(r.set.backend, r.names, r.set.host, peer, shmAnswer{known: true, err: r.probeShm(cc)})
	}
	if c.passed != nil {
		r.log.Info("shm not usable with this peer, falling back", "peer", peer.Endpoint, "peer_rank", peer.Rank, "reason", c.passed)
	}
	return c.backend, true, c.err
}

// probeShm checks once per control connection that this rank can reach
// the peer's shm endpoint and map memory with it (same host and namespace,
// working memory files); the connection keeps the answer while it is
// open.
func (r *rank) probeShm(cc *control.Conn) error {
	return cc.Probe(func() error {
		peer := cc.Peer()
		i := slices.Index(peer.Backends, "shm")
		if i < 0 || i >= len(peer.Endpoints) {
			return fmt.Errorf("the peer announced no shm endpoint")
		}
		// The receiving side probes in the direction of the data: ask our
		// shm transport to reach the peer's (both directions need the same
		// host and namespace).
		p, ok := r.transports["shm"].(transport.Prober)
		if !ok {
			return fmt.Errorf("the shm backend cannot probe")
		}
		ctx, cancel := context.WithTimeout(r.life, 5*time.Second)
		defer cancel()
		return p.Probe(ctx, peer.Endpoints[i])
	})
}
