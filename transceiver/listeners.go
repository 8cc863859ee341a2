package transceiver

import "strconv"

// Listener is one address a rank of the transceiver listens on.
type Listener struct {
	// Rank is the rank that listens.
	Rank int
	// Plane is "control" or the data backend ("tcp", "shm", "ucx").
	Plane string
	// Addr is where: host:port for control and tcp; the abstract Unix
	// socket ("@kvxfer-shm-<hex>", reachable by every process of the host
	// in the same network namespace, no TCP port) for shm; for ucx, the
	// listen host and the network devices UCX listens on ("127.0.0.1
	// (lo)"), since UCX picks its ports itself.
	Addr string
}

// String formats l for logs: "rank 0 control 127.0.0.1:41233".
func (l Listener) String() string {
	return "rank " + strconv.Itoa(l.Rank) + " " + l.Plane + " " + l.Addr
}

// addrLister is implemented by backends whose Endpoint is not where they
// listen (ucx: a worker address).
type addrLister interface{ ListenAddrs() []string }

// Listeners returns every address the transceiver listens on: per rank,
// its control listener and each data backend's, in rank and backend order.
func (t *Transceiver) Listeners() []Listener {
	var out []Listener
	for _, r := range t.ranks {
		out = append(out, Listener{Rank: r.idx, Plane: "control", Addr: r.ctrl.Endpoint()})
		for _, n := range r.names {
			tr := r.transports[n]
			if al, ok := tr.(addrLister); ok {
				for _, a := range al.ListenAddrs() {
					out = append(out, Listener{Rank: r.idx, Plane: n, Addr: a})
				}
				continue
			}
			out = append(out, Listener{Rank: r.idx, Plane: n, Addr: tr.Endpoint()})
		}
	}
	return out
}

// Limits returns the connection limits of every rank (defaults filled in).
func (t *Transceiver) Limits() ConnLimits {
	if len(t.ranks) == 0 {
		return ConnLimits{}.withDefaults()
	}
	return t.ranks[0].set.limits
}
