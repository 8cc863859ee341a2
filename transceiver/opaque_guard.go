package transceiver

import (
	"container/heap"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/transport"

	"github.com/kvxfer/kvxfer/config"
)

// DefaultNonceCacheSize is the number of unexpired opaque-state nonces a
// generation instance remembers when Options.NonceCacheSize is 0.
const DefaultNonceCacheSize = 1 << 16

// resolveTimeout bounds the resolution of the allow-list's host names in New.
const resolveTimeout = 3 * time.Second

// opaqueGuard holds what a generation instance checks an opaque state
// against before it dials anything: the MAC key, the clock, the nonces it
// has accepted and the peer allow-list. It is safe for concurrent use.
type opaqueGuard struct {
	key   []byte // MAC key derived from the cluster secret; nil: no secret
	peers *peerPolicy
	now   func() time.Time

	mu   sync.Mutex
	seen map[[16]byte]time.Time // nonce → expiry
	exp  nonceHeap              // the same nonces, soonest expiry first
	max  int
}

func newOpaqueGuard(secret []byte, peers *peerPolicy, now func() time.Time, max int) *opaqueGuard {
	g := &opaqueGuard{peers: peers, now: now, seen: map[[16]byte]time.Time{}, max: max}
	if len(secret) > 0 {
		g.key = macKey(secret)
	}
	if g.max <= 0 {
		g.max = DefaultNonceCacheSize
	}
	return g
}

// check applies, in order: signature (with a secret: unsigned and forged
// states are refused), expiry, the allow-list of every endpoint, and the
// nonce (with a secret: a nonce accepted before is refused). With consume
// the nonce is recorded, so that the same state is refused next time.
//
// Without a secret a signed state's MAC cannot be checked: it is ignored,
// its expiry still counts, nonces are not tracked (anyone could mint new
// ones), and the allow-list (loopback plus allowed hosts) is what keeps the
// dial targets in check.
func (g *opaqueGuard) check(op *OpaqueState, consume bool) error {
	if g.key != nil {
		if !op.Signed {
			return fmt.Errorf("%w: context request %d: this instance has a cluster secret and accepts only opaque states signed with it (does the context instance run with the same secret?)", ErrUnsignedOpaqueState, op.RequestID)
		}
		if !op.validMAC(g.key) {
			return fmt.Errorf("%w: context request %d: the MAC does not match the content (a field was changed, or the context instance has another cluster secret)", ErrForgedOpaqueState, op.RequestID)
		}
	}
	now := g.now()
	if op.Signed && !now.Before(op.Expiry) {
		return fmt.Errorf("%w: context request %d expired at %s (%v ago): the context instance has released its KV cache; run the context phase again",
			ErrExpiredOpaqueState, op.RequestID, op.Expiry.UTC().Format(time.RFC3339Nano), now.Sub(op.Expiry).Round(time.Millisecond))
	}
	for i, ep := range op.Endpoints {
		if err := g.peers.endpointCheck(ep); err != nil {
			return fmt.Errorf("context rank %d: %w", i, err) // (each error names the endpoint or its host)
		}
	}
	if g.key == nil {
		return nil
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.prune(now)
	if _, dup := g.seen[op.Nonce]; dup {
		return fmt.Errorf("%w: context request %d: this instance has already accepted this opaque state; a state is good for one generation request (or, after a pull of it that failed, another)", ErrReplayedOpaqueState, op.RequestID)
	}
	if !consume {
		return nil
	}
	if len(g.seen) >= g.max {
		return fmt.Errorf("%w: %d unexpired states accepted, the oldest expires in %v", ErrReplayCacheFull, len(g.seen), g.exp[0].exp.Sub(now).Round(time.Millisecond))
	}
	g.seen[op.Nonce] = op.Expiry
	heap.Push(&g.exp, nonceAt{op.Nonce, op.Expiry})
	return nil
}

// giveBack forgets nonce, of a state accepted for a pull that failed
// without the context instance refusing it: the state's owner may pull it
// again, here too. (The context instance holds the request for that, and
// refuses a state it no longer holds; a state that was pulled keeps its
// nonce.)
func (g *opaqueGuard) giveBack(nonce [16]byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.seen[nonce]; !ok {
		return
	}
	delete(g.seen, nonce)
	for i, n := range g.exp {
		if n.nonce == nonce {
			heap.Remove(&g.exp, i)
			break
		}
	}
}

// prune forgets the nonces whose states have expired: an expired state is
// refused for its expiry anyway. Called with g.mu held.
func (g *opaqueGuard) prune(now time.Time) {
	for len(g.exp) > 0 && !now.Before(g.exp[0].exp) {
		n := heap.Pop(&g.exp).(nonceAt)
		delete(g.seen, n.nonce)
	}
}

// nonces returns the number of nonces remembered (for tests).
func (g *opaqueGuard) nonces() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.seen)
}

type nonceAt struct {
	nonce [16]byte
	exp   time.Time
}

// nonceHeap is a min-heap of nonces by expiry.
type nonceHeap []nonceAt

func (h nonceHeap) Len() int           { return len(h) }
func (h nonceHeap) Less(i, j int) bool { return h[i].exp.Before(h[j].exp) }
func (h nonceHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *nonceHeap) Push(x any)        { *h = append(*h, x.(nonceAt)) }
func (h *nonceHeap) Pop() any {
	old := *h
	n := old[len(old)-1]
	*h = old[:len(old)-1]
	return n
}

// peerPolicy says which hosts a rank may dial for a transfer and accept
// control connections from.
//
// Dialling: loopback (and the unspecified address, which reaches this
// host) is always allowed; with a cluster secret and no allow-list any
// host is (the signed state vouches for its endpoints); otherwise only the
// hosts on the allow-list. Accepting: with an allow-list, loopback and the
// hosts on it; without one, anyone (the transfer token guards each request).
//
// An allow-list entry is an IP address, a CIDR prefix or a host name; a name
// matches an endpoint that names it, or whose address it resolved to when
// the transceiver started.
type peerPolicy struct {
	list     []string // canonical entries, for messages
	open     bool     // dial anything: a secret and no allow-list
	names    map[string]bool
	addrs    map[netip.Addr]bool
	prefixes []netip.Prefix

	lastLog    atomic.Int64 // unix nanoseconds of the last refusal logged
	suppressed atomic.Int64 // refusals not logged since
}

// newPeerPolicy parses the allow-list and resolves its host names (bounded
// by ctx and resolveTimeout). A name that does not resolve still matches
// endpoints that name it; it is logged.
func newPeerPolicy(ctx context.Context, hosts []string, secret bool, lookup func(context.Context, string) ([]netip.Addr, error), log *slog.Logger) (*peerPolicy, error) {
	p := &peerPolicy{open: secret && len(hosts) == 0, names: map[string]bool{}, addrs: map[netip.Addr]bool{}}
	if lookup == nil {
		lookup = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	rctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	for _, h := range hosts {
		c, err := config.ParsePeerHost(h)
		if err != nil {
			return nil, fmt.Errorf("transceiver: allowed peer host: %w", err)
		}
		p.list = append(p.list, c)
		if a, err := netip.ParseAddr(c); err == nil {
			p.addrs[a] = true
			continue
		}
		if pf, err := netip.ParsePrefix(c); err == nil {
			p.prefixes = append(p.prefixes, pf)
			continue
		}
		p.names[strings.TrimSuffix(c, ".")] = true
		addrs, err := lookup(rctx, c)
		if err != nil {
			log.Warn("allowed peer host does not resolve: only endpoints that name it match it", "host", c, "err", err)
			continue
		}
		for _, a := range addrs {
			p.addrs[a.Unmap()] = true
		}
	}
	return p, nil
}

func (p *peerPolicy) configured() bool { return len(p.list) > 0 }

// listed reports whether address a is on the allow-list.
func (p *peerPolicy) listed(a netip.Addr) bool {
	if p.addrs[a] {
		return true
	}
	for _, pf := range p.prefixes {
		if pf.Contains(a) {
			return true
		}
	}
	return false
}

// dialCheck returns nil when host (an endpoint's host, no port) may be
// dialled, else an error wrapping ErrPeerNotAllowed that says how to allow
// it.
func (p *peerPolicy) dialCheck(host string) error {
	if a, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil && a.Zone() == "" {
		a = a.Unmap()
		if a.IsLoopback() || a.IsUnspecified() || p.open || p.listed(a) {
			return nil
		}
	} else if err == nil {
		// A zoned (link-local) address: allowed only when open.
		if p.open {
			return nil
		}
	} else {
		name := strings.ToLower(strings.TrimSuffix(host, "."))
		if name == "localhost" || p.open || p.names[name] {
			return nil
		}
	}
	how := "add it to security.allowed_peer_hosts or to " + config.EnvAllowedPeerHosts
	if !p.configured() {
		how += ", or give both instances the cluster secret (security.secret_file, " + config.EnvClusterSecret + ")"
	}
	return fmt.Errorf("%w: host %s is not loopback and not on the allow-list %v: %s", ErrPeerNotAllowed, host, p.list, how)
}

// dataCheck returns nil when this rank may send a generation peer's data to
// host, the host a descriptor of that peer names (transport.Dialer), peer
// being the remote address of the control connection the descriptor came
// on (empty: unknown). A descriptor is the peer's choice, signed by nobody,
// so neither the secret nor "open" widens this: host must be the peer's
// own address, or loopback when the peer itself is on this host, or on the
// allow-list. Else the error wraps ErrPeerNotAllowed and
// transport.ErrBadDescriptor (the peer's fault), naming the host.
func (p *peerPolicy) dataCheck(host, peer string) error {
	pa, perr := netip.ParseAddr(strings.Trim(peer, "[]"))
	local := perr == nil && pa.Unmap().IsLoopback()
	if a, err := netip.ParseAddr(strings.Trim(host, "[]")); err == nil && a.Zone() == "" {
		a = a.Unmap()
		if (perr == nil && a == pa.Unmap()) || ((a.IsLoopback() || a.IsUnspecified()) && local) || p.listed(a) {
			return nil
		}
	} else if err != nil {
		name := strings.ToLower(strings.TrimSuffix(host, "."))
		if (name == "localhost" && local) || p.names[name] {
			return nil
		}
	}
	who := "the generation peer at " + peer
	if peer == "" {
		who = "a generation peer whose control connection is gone"
	}
	return fmt.Errorf("%w: %w: %s named host %s as its data endpoint, which is neither its own address, nor loopback of a peer on this host, nor on the allow-list %v: add it to security.allowed_peer_hosts or to %s",
		ErrPeerNotAllowed, transport.ErrBadDescriptor, who, host, p.list, config.EnvAllowedPeerHosts)
}

// endpointCheck is dialCheck for a control endpoint (host:port).
func (p *peerPolicy) endpointCheck(endpoint string) error {
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return fmt.Errorf("%w: endpoint %q is not host:port", ErrBadOpaqueState, endpoint)
	}
	return p.dialCheck(host)
}

// accepter is acceptOK for a control listener, logging each refusal
// (logRefusal) to log.
func (p *peerPolicy) accepter(log *slog.Logger) func(net.Addr) bool {
	return func(a net.Addr) bool {
		if !p.acceptOK(a) {
			p.logRefusal(log, a)
			return false
		}
		return true
	}
}

// acceptOK reports whether a control connection from addr may be served.
func (p *peerPolicy) acceptOK(addr net.Addr) bool {
	if !p.configured() {
		return true
	}
	ap, err := netip.ParseAddrPort(addr.String())
	if err != nil {
		return false
	}
	a := ap.Addr().WithZone("").Unmap()
	return a.IsLoopback() || p.listed(a)
}

// refuseLogEvery bounds the log lines about refused connections.
const refuseLogEvery = 10 * time.Second

// logRefusal logs a refused connection, at most once per refuseLogEvery,
// with the number of refusals not logged since the last line.
func (p *peerPolicy) logRefusal(log *slog.Logger, addr net.Addr) {
	now := time.Now().UnixNano()
	last := p.lastLog.Load()
	if now-last < int64(refuseLogEvery) || !p.lastLog.CompareAndSwap(last, now) {
		p.suppressed.Add(1)
		return
	}
	log.Warn("refused a control connection from a host not on the allow-list", "from", addr.String(),
		"allowed", p.list, "refusals_not_logged", p.suppressed.Swap(0))
}
