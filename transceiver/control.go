package transceiver

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
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

// backendEndpoints returns the data-plane endpoint of each backend, in the
// order of r.names.
func (r *rank) backendEndpoints() []string {
	eps := make([]string, len(r.names))
	for i, n := range r.names {
		eps[i] = r.transports[n].Endpoint()
	}
	return eps
}

// hello is what the rank tells of itself when a control connection opens,
// in either direction.
func (r *rank) hello() wire.Hello {
	st, _ := r.state.MarshalBinary()
	return wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.names, Endpoints: r.backendEndpoints()}
}

// pickBackend picks the data plane for the pair over cc (chooseBackend),
// probing the peer's shm endpoint when the choice needs it; unless
// mayWait, it reports ok false instead of waiting for a probe that has not
// been answered yet.
func (r *rank) pickBackend(cc *control.Conn, mayWait bool) (backend string, ok bool, err error) {
	peer := cc.Peer()
	c := chooseBackend(r.set.backend, r.names, r.set.host, peer, r.shmAnswer(cc))
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

// shmAnswer returns what is known of the probe of cc's peer.
func (r *rank) shmAnswer(cc *control.Conn) shmAnswer {
	r.mu.Lock()
	pr := r.probes[connID(cc.ID())]
	r.mu.Unlock()
	if pr == nil || !pr.answered.Load() {
		return shmAnswer{}
	}
	return shmAnswer{known: true, err: pr.err}
}

// shmProbe is the answer of one probe of a peer's shm endpoint.
type shmProbe struct {
	once     sync.Once
	err      error
	answered atomic.Bool // err is set
}

// probeShm checks once per control connection that this rank can reach
// the peer's shm endpoint and map memory with it (same host and namespace,
// working memory files); the answer is kept while the connection is open.
func (r *rank) probeShm(cc *control.Conn) error {
	id := connID(cc.ID())
	r.mu.Lock()
	pr := r.probes[id]
	if pr == nil {
		pr = &shmProbe{}
		if r.ctrl.Conn(cc.ID()) != nil { // else Lost has forgotten it, or is about to
			r.probes[id] = pr
		}
	}
	r.mu.Unlock()
	pr.once.Do(func() {
		peer := cc.Peer()
		i := slices.Index(peer.Backends, "shm")
		if i < 0 || i >= len(peer.Endpoints) {
			pr.err = fmt.Errorf("the peer announced no shm endpoint")
			return
		}
		// The receiving side probes in the direction of the data: ask our
		// shm transport to reach the peer's (both directions need the same
		// host and namespace).
		p, ok := r.transports["shm"].(transport.Prober)
		if !ok {
			pr.err = fmt.Errorf("the shm backend cannot probe")
			return
		}
		ctx, cancel := context.WithTimeout(r.life, 5*time.Second)
		defer cancel()
		pr.err = p.Probe(ctx, peer.Endpoints[i])
	})
	pr.answered.Store(true)
	return pr.err
}
