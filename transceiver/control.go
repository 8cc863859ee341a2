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

// What the rank tells of itself on its control connections, and the
// policy it applies to what a peer tells: the choice of backend for a
// pair. The connections themselves are internal/control's.

func (r *rank) backendNames() []string {
	names := make([]string, 0, len(r.transports))
	for n := range r.transports {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// backendEndpoints returns the data-plane endpoint of each backend, in the
// order of backendNames.
func (r *rank) backendEndpoints() []string {
	names := r.backendNames()
	eps := make([]string, len(names))
	for i, n := range names {
		eps[i] = r.transports[n].Endpoint()
	}
	return eps
}

// hello is what the rank tells of itself when a control connection opens,
// in either direction.
func (r *rank) hello() wire.Hello {
	st, _ := r.state.MarshalBinary()
	return wire.Hello{Version: wire.Version, Rank: uint32(r.idx), State: st, Host: r.set.host, Backends: r.backendNames(), Endpoints: r.backendEndpoints()}
}

// chooseBackend picks the data plane for a pair: the configured one, or
// with AUTO shm with a peer on this host that it reaches, else ucx, else
// tcp.
func (r *rank) chooseBackend(cc *control.Conn) (string, error) {
	b, _, err := r.pickBackend(cc, true)
	return b, err
}

// pickBackend is chooseBackend; unless mayWait, it reports ok false
// instead of waiting for a probe of the peer's shm endpoint that has not
// been answered yet.
func (r *rank) pickBackend(cc *control.Conn, mayWait bool) (backend string, ok bool, err error) {
	peer := cc.Peer()
	has := func(name string) bool {
		_, mine := r.transports[name]
		return mine && slices.Contains(peer.Backends, name)
	}
	if r.set.backend != "auto" {
		if !has(r.set.backend) {
			return "", true, fmt.Errorf("%w: backend %s: context rank %d at %s has %v open, this rank %v",
				transport.ErrNotBuilt, r.set.backend, peer.Rank, peer.Endpoint, peer.Backends, r.backendNames())
		}
		return r.set.backend, true, nil
	}
	for _, b := range autoOrder() {
		switch {
		case !has(b):
		case b != "shm":
			return b, true, nil
		case peer.Host == r.set.host:
			if !mayWait && !r.probed(cc) {
				return "", false, nil
			}
			err := r.probeShm(cc)
			if err == nil {
				return b, true, nil
			}
			r.log.Info("shm not usable with this peer, falling back", "peer", peer.Endpoint, "peer_rank", peer.Rank, "reason", err)
		}
	}
	return "", true, fmt.Errorf("no backend in common with context rank %d at %s (it has %v, this rank %v)", peer.Rank, peer.Endpoint, peer.Backends, r.backendNames())
}

// probed reports whether the probe of cc's peer has been answered.
func (r *rank) probed(cc *control.Conn) bool {
	r.mu.Lock()
	pr := r.probes[connID(cc.ID())]
	r.mu.Unlock()
	return pr != nil && pr.answered.Load()
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
