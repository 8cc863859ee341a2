package link

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transport"
)

// ProbeTimeout bounds one probe of a peer's shm endpoint.
const ProbeTimeout = 5 * time.Second

// Config is what a Linker needs. Every field but Log is required.
type Config struct {
	Plane *control.Plane // the rank's control connections
	// Want is the backend configured for the rank: a data-plane name, or
	// "auto" to choose per peer in the order of Auto.
	Want string
	Auto []string
	// Transports are the rank's data planes, by name; the map is read,
	// never changed.
	Transports map[string]transport.Transport
	Host       string       // this rank's host, as its Hello tells it
	Log        *slog.Logger // nil: discard
}

// Linker reaches the context ranks a rank pulls from.
type Linker struct {
	cfg   Config
	names []string        // of cfg.Transports, sorted
	life  context.Context // ends at Close: bounds probes
	stop  context.CancelFunc
}

// New returns a Linker for cfg.
func New(cfg Config) *Linker {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	life, stop := context.WithCancel(context.Background())
	return &Linker{cfg: cfg, names: slices.Sorted(maps.Keys(cfg.Transports)), life: life, stop: stop}
}

// Close ends the probes in progress (their pairs fall back as for a peer
// that cannot be probed) and those that start later. It is idempotent;
// the Plane is the caller's to close.
func (k *Linker) Close() { k.stop() }

// Link is a context rank reached: the control connection to it, held until
// Release, and the data plane of the pair.
type Link struct {
	Conn      *control.Conn
	Backend   string
	Transport transport.Transport
	release   func()
}

// Release gives the hold on the connection back (see control.Plane.Dial):
// it may then close when idle. Call it once the connection has work on it
// that keeps it busy, or none to do.
func (l Link) Release() { l.release() }

// Get reaches the context rank at endpoint. Unless wait, it returns ok
// false, and nothing to release, where it would wait: no live connection
// to endpoint in the dial cache, or a probe of the peer's shm endpoint not
// answered yet. With wait it dials (ctx bounds the dial) and probes as
// needed. An error (a failed dial, no data plane in common) comes with ok
// true and nothing to release.
func (k *Linker) Get(ctx context.Context, endpoint string, wait bool) (l Link, ok bool, err error) {
	var cc *control.Conn
	var release func()
	if wait {
		cc, release, err = k.cfg.Plane.Dial(ctx, endpoint)
	} else if cc, release, ok, err = k.cfg.Plane.Cached(endpoint); err == nil && !ok {
		return Link{}, false, nil
	}
	if err != nil {
		return Link{}, true, err
	}
	peer := cc.Peer()
	probed, known := cc.Probed()
	c := chooseBackend(k.cfg.Want, k.cfg.Auto, k.names, k.cfg.Host, peer, shmAnswer{known: known, err: probed})
	if c.probe {
		if !wait {
			release()
			return Link{}, false, nil
		}
		c = chooseBackend(k.cfg.Want, k.cfg.Auto, k.names, k.cfg.Host, peer, shmAnswer{known: true, err: k.probeShm(cc)})
	}
	if c.passed != nil {
		k.cfg.Log.Info("shm not usable with this peer, falling back", "peer", peer.Endpoint, "peer_rank", peer.Rank, "reason", c.passed)
	}
	if c.err != nil {
		release()
		return Link{}, true, c.err
	}
	return Link{Conn: cc, Backend: c.backend, Transport: k.cfg.Transports[c.backend], release: release}, true, nil
}

// Reach reaches the context rank at endpoint as Get does and hands done
// the link, to release, or the error. done runs on the caller's goroutine
// where nothing needs a wait (the connection is in the dial cache, its
// backend chosen), else on the goroutine start runs it on, which dials
// and probes as needed; ctx bounds the dial.
func (k *Linker) Reach(ctx context.Context, endpoint string, start func(func()), done func(Link, error)) {
	if l, ok, err := k.Get(ctx, endpoint, false); ok {
		done(l, err)
		return
	}
	start(func() {
		l, _, err := k.Get(ctx, endpoint, true)
		done(l, err)
	})
}

// probeShm checks once per control connection that this rank can reach
// the peer's shm endpoint and map memory with it (same host and namespace,
// working memory files); the connection keeps the answer while it is
// open.
func (k *Linker) probeShm(cc *control.Conn) error {
	return cc.Probe(func() error {
		peer := cc.Peer()
		i := slices.Index(peer.Backends, "shm")
		if i < 0 || i >= len(peer.Endpoints) {
			return errors.New("the peer announced no shm endpoint")
		}
		// The receiving side probes in the direction of the data: ask our
		// shm transport to reach the peer's (both directions need the same
		// host and namespace).
		p, ok := k.cfg.Transports["shm"].(transport.Prober)
		if !ok {
			return errors.New("the shm backend cannot probe")
		}
		ctx, cancel := context.WithTimeout(k.life, ProbeTimeout)
		defer cancel()
		return p.Probe(ctx, peer.Endpoints[i])
	})
}
