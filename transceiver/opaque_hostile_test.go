package transceiver

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
)

// The hostile suite of the signed opaque state and the peer allow-list
// (issue #10): each attack must be refused with its documented error, before
// anything is dialled, and the instance must go on serving genuine requests.

var testSecret = bytes.Repeat([]byte("cluster-secret/"), 3) // 45 bytes

// fakeClock is a clock that tests move forward by hand; it starts at the
// wall clock so that it agrees with the transceiver's real timers.
type fakeClock struct{ off atomic.Int64 }

func (c *fakeClock) Now() time.Time          { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *fakeClock) Advance(d time.Duration) { c.off.Add(int64(d)) }

func withSecret(secret []byte, clk *fakeClock) func(*Options) {
	return func(o *Options) {
		o.Secret = secret
		if clk != nil {
			o.Now = clk.Now
		}
	}
}

func withPeers(hosts ...string) func(*Options) {
	return func(o *Options) { o.AllowedPeerHosts = hosts }
}

// dialedCount is the number of endpoints the instance's ranks have dialled
// (or are dialling).
func dialedCount(in *inst) int {
	n := 0
	for _, r := range in.t.ranks {
		n += r.ctrl.Dialled()
	}
	return n
}

var hostileID atomic.Uint64

// refusedBeforeDial hands enc to the generation instance and checks that it
// is refused with want, synchronously, with nothing started: no request in
// flight, no endpoint dialled, no connection opened, no block kept. It
// returns the error.
func refusedBeforeDial(t *testing.T, gen *inst, enc []byte, want error) error {
	t.Helper()
	dialed, conns := dialedCount(gen), gen.t.ControlConnections()
	if _, err := gen.t.CheckOpaque(enc); !errors.Is(err, want) {
		t.Fatalf("CheckOpaque: %v, want %v", err, want)
	}
	blocks := gen.alloc(t, 0, 2)
	defer gen.release(t, blocks)
	greq := &Request{ID: 1<<40 + hostileID.Add(1), Type: GenerationOnly, Blocks: blocks,
		ContextPhase: &ContextPhaseParams{OpaqueState: enc}}
	err := gen.t.RequestAndReceiveAsync(greq)
	if !errors.Is(err, want) {
		t.Fatalf("RequestAndReceiveAsync: %v, want %v", err, want)
	}
	if !gen.t.GenTransferComplete() {
		t.Error("a refused request is in flight")
	}
	if d, c := dialedCount(gen), gen.t.ControlConnections(); d != dialed || c != conns {
		t.Errorf("the refusal dialled: %d endpoints and %d connections, %d and %d before", d, c, dialed, conns)
	}
	return err
}

// pullGenuine pulls a context request with its genuine state and checks it
// succeeds.
func pullGenuine(t *testing.T, gen *inst, creq *Request) {
	t.Helper()
	greq := genReqFor(gen, t, creq, 2)
	defer gen.release(t, greq.Blocks)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(ctx, greq); err != nil {
		t.Fatalf("the genuine pull of context request %d: %v", creq.ID, err)
	}
}

// countingListener is a listener that reports every connection it accepts.
type countingListener struct {
	ln    net.Listener
	done  chan struct{}
	mu    sync.Mutex
	conns []net.Conn
	from  chan string // the remote address of each accepted connection
}

func newCountingListener(t *testing.T) *countingListener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &countingListener{ln: ln, done: make(chan struct{}), from: make(chan string, 64)}
	go func() {
		defer close(l.done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.mu.Lock()
			l.conns = append(l.conns, c)
			l.mu.Unlock()
			select {
			case l.from <- c.RemoteAddr().String():
			default: // a flood: counted as soon as the probe is read
			}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-l.done
		l.mu.Lock()
		for _, c := range l.conns {
			c.Close()
		}
		l.mu.Unlock()
	})
	return l
}

// assertNeverConnected checks that nobody but a probe of its own connected:
// a connection made earlier sits ahead of the probe in the accept queue, so
// once the probe is accepted every earlier one has been seen.
func (l *countingListener) assertNeverConnected(t *testing.T) {
	t.Helper()
	c, err := net.Dial("tcp", l.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	probe := c.LocalAddr().String()
	timeout := time.NewTimer(5 * time.Second)
	defer timeout.Stop()
	others := 0
	for {
		select {
		case from := <-l.from:
			if from != probe {
				others++
				continue
			}
		case <-timeout.C:
			t.Fatal("the probe connection was not accepted")
		}
		break
	}
	l.mu.Lock()
	n := len(l.conns)
	l.mu.Unlock()
	if others > 0 || n != 1 {
		t.Errorf("the listener named by a forged endpoint was connected to %d times", n-1)
	}
}

func decodeOpaque(t *testing.T, b []byte) *OpaqueState {
	t.Helper()
	var op OpaqueState
	if err := op.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	return &op
}

func marshal(t *testing.T, op *OpaqueState) []byte {
	t.Helper()
	b, err := op.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestHostileOpaqueStates: tampered, re-signed, downgraded, truncated,
// expired, replayed and unsigned states are refused before any dial, the
// listener a forged endpoint names is never connected to, and each genuine
// state still works after its forgeries were refused.
func TestHostileOpaqueStates(t *testing.T) {
	cs := state(2, 2, 16, 4, kvcache.BF16, 2, 1, false) // two context ranks: two endpoints
	gs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	clk := &fakeClock{}
	sender := newInst(t, cs, testCfg(), 64, withSecret(testSecret, clk))
	gen := newInst(t, gs, testCfg(), 64, withSecret(testSecret, clk))
	trap := newCountingListener(t)
	otherKey := macKey(bytes.Repeat([]byte("x"), 32))

	tamper := []struct {
		name string
		edit func(t *testing.T, enc []byte) []byte
		want error
	}{
		{"a byte of an endpoint flipped", func(t *testing.T, enc []byte) []byte {
			ep := []byte(sender.t.Endpoints()[1])
			i := bytes.Index(enc, ep)
			if i < 0 {
				t.Fatal("endpoint not found in the encoding")
			}
			enc[i+len(ep)-1] ^= 1 // another port
			return enc
		}, ErrForgedOpaqueState},
		{"an endpoint pointing at another listener", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Endpoints[0] = trap.ln.Addr().String()
			return marshal(t, op) // the old MAC
		}, ErrForgedOpaqueState},
		{"re-signed with another secret", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Endpoints[0] = trap.ln.Addr().String()
			op.covered = nil
			if err := op.sign(otherKey, clk.Now().Add(time.Minute)); err != nil {
				t.Fatal(err)
			}
			return marshal(t, op)
		}, ErrForgedOpaqueState},
		{"expiry pushed back", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Expiry = op.Expiry.Add(time.Hour)
			return marshal(t, op)
		}, ErrForgedOpaqueState},
		{"nonce changed (to dodge the replay check)", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Nonce[0] ^= 0xff
			return marshal(t, op)
		}, ErrForgedOpaqueState},
		{"token changed", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Token[15] ^= 1
			return marshal(t, op)
		}, ErrForgedOpaqueState},
		{"MAC zeroed", func(t *testing.T, enc []byte) []byte {
			clear(enc[len(enc)-macSize:])
			return enc
		}, ErrForgedOpaqueState},
		{"MAC cut off", func(t *testing.T, enc []byte) []byte { return enc[:len(enc)-macSize] }, ErrBadOpaqueState},
		{"downgraded to the unsigned form", func(t *testing.T, enc []byte) []byte {
			op := decodeOpaque(t, enc)
			op.Signed = false
			return marshal(t, op)
		}, ErrUnsignedOpaqueState},
	}
	for i, tc := range tamper {
		t.Run(tc.name, func(t *testing.T) {
			creq, _ := startSend(t, sender, uint64(100+i), 8)
			if op := decodeOpaque(t, creq.ContextPhase.OpaqueState); !op.Signed || op.Expiry.IsZero() {
				t.Fatalf("a context instance with a secret handed out an unsigned state: %+v", op)
			}
			forged := tc.edit(t, bytes.Clone(creq.ContextPhase.OpaqueState))
			refusedBeforeDial(t, gen, forged, tc.want)
			// The refusal took nothing from the genuine state (its nonce
			// included): it still pulls.
			pullGenuine(t, gen, creq)
		})
	}

	t.Run("expired", func(t *testing.T) {
		creq, _ := startSend(t, sender, 200, 8)
		clk.Advance(10*time.Second + time.Millisecond) // testCfg's kv_transfer_timeout_ms
		err := refusedBeforeDial(t, gen, creq.ContextPhase.OpaqueState, ErrExpiredOpaqueState)
		if !strings.Contains(err.Error(), "released its KV cache") {
			t.Errorf("message: %v", err)
		}
		sender.t.Cancel(creq)
		waitDone(t, creq, 5*time.Second)
		fresh, _ := startSend(t, sender, 201, 8)
		pullGenuine(t, gen, fresh)
	})

	t.Run("replayed after its pull", func(t *testing.T) {
		creq, _ := startSend(t, sender, 300, 8)
		pullGenuine(t, gen, creq)
		refusedBeforeDial(t, gen, creq.ContextPhase.OpaqueState, ErrReplayedOpaqueState)
		fresh, _ := startSend(t, sender, 301, 8)
		pullGenuine(t, gen, fresh)
	})

	t.Run("replayed while its pull is in flight", func(t *testing.T) {
		creq, _ := startSend(t, sender, 400, 8)
		first := genReqFor(gen, t, creq, 2)
		if err := gen.t.RequestAndReceiveAsync(first); err != nil {
			t.Fatal(err)
		}
		second := genReqFor(gen, t, creq, 2)
		second.ID++
		if err := gen.t.RequestAndReceiveAsync(second); !errors.Is(err, ErrReplayedOpaqueState) {
			t.Fatalf("second pull of one state: %v", err)
		}
		gen.release(t, second.Blocks)
		waitDone(t, first, 10*time.Second)
		if first.Err() != nil {
			t.Fatalf("the first pull: %v", first.Err())
		}
		gen.release(t, first.Blocks)
		if _, err := gen.t.CheckGenTransferStatus(context.Background(), -1); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("unsigned, from a context instance without the secret", func(t *testing.T) {
		plain := newInst(t, cs, testCfg(), 16)
		creq, _ := startSend(t, plain, 500, 8)
		if decodeOpaque(t, creq.ContextPhase.OpaqueState).Signed {
			t.Fatal("an instance without a secret signed its state")
		}
		err := refusedBeforeDial(t, gen, creq.ContextPhase.OpaqueState, ErrUnsignedOpaqueState)
		if !strings.Contains(err.Error(), "same secret") {
			t.Errorf("message: %v", err)
		}
		plain.t.Cancel(creq)
		waitDone(t, creq, 5*time.Second)
		fresh, _ := startSend(t, sender, 501, 8)
		pullGenuine(t, gen, fresh)
	})

	t.Run("another cluster's signed state", func(t *testing.T) {
		stranger := newInst(t, cs, testCfg(), 16, withSecret(bytes.Repeat([]byte("y"), 32), clk))
		creq, _ := startSend(t, stranger, 600, 8)
		refusedBeforeDial(t, gen, creq.ContextPhase.OpaqueState, ErrForgedOpaqueState)
		stranger.t.Cancel(creq)
		waitDone(t, creq, 5*time.Second)
	})

	// Every genuine pull above went to the context instance; nothing went
	// to the listener the forged endpoints named. Close the generation
	// instance first: it waits for every goroutine that could have dialled.
	if err := gen.t.Close(); err != nil {
		t.Fatal(err)
	}
	trap.assertNeverConnected(t)
	if got, err := sender.t.CheckContextTransferStatus(context.Background(), -1); err != nil {
		t.Fatalf("context side: %v (%d requests)", err, len(got))
	}
}

// TestPeerAllowList: which endpoints a generation instance dials, with and
// without a secret and an allow-list; refused ones are refused before any
// dial, with the host and how to allow it in the message.
func TestPeerAllowList(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	unsigned := func(eps ...string) []byte {
		return marshal(t, &OpaqueState{RequestID: 7, State: s, Endpoints: eps})
	}
	signed := func(secret []byte, eps ...string) []byte {
		op := &OpaqueState{RequestID: 7, State: s, Endpoints: eps}
		if err := op.sign(macKey(secret), time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		return marshal(t, op)
	}

	t.Run("no secret: loopback only", func(t *testing.T) {
		sender := newInst(t, s, testCfg(), 16)
		gen := newInst(t, s, testCfg(), 16)
		for _, ep := range []string{"10.255.255.1:9", "[2001:db8::1]:9", "evil.example:80", "[::ffff:10.0.0.1]:9"} {
			err := refusedBeforeDial(t, gen, unsigned(ep), ErrPeerNotAllowed)
			host, _, _ := net.SplitHostPort(ep)
			for _, want := range []string{"host " + host + " ", "security.allowed_peer_hosts", config.EnvAllowedPeerHosts, config.EnvClusterSecret} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%s: the message lacks %q: %v", ep, want, err)
				}
			}
		}
		// One bad endpoint among good ones is enough.
		refusedBeforeDial(t, gen, marshal(t, &OpaqueState{RequestID: 7, State: state(2, 2, 16, 4, kvcache.BF16, 2, 1, false),
			Endpoints: []string{"127.0.0.1:9", "10.255.255.1:9"}}), ErrPeerNotAllowed)
		for _, ep := range []string{"127.0.0.1:9", "127.9.9.9:9", "[::1]:9", "localhost:9", "LOCALHOST.:9", "0.0.0.0:9"} {
			if _, err := gen.t.CheckOpaque(unsigned(ep)); err != nil {
				t.Errorf("%s: %v", ep, err)
			}
		}
		transfer(t, sender, gen, 1, 8, 1, 0, 0)
	})

	t.Run("no secret, allowed hosts", func(t *testing.T) {
		gen := newInst(t, s, testCfg(), 16, withPeers("10.255.255.1", "10.7.0.0/16"))
		for _, ep := range []string{"10.255.255.1:9", "10.7.200.3:9", "[::ffff:10.7.0.1]:9"} {
			if _, err := gen.t.CheckOpaque(unsigned(ep)); err != nil {
				t.Errorf("%s: %v", ep, err)
			}
		}
		err := refusedBeforeDial(t, gen, unsigned("10.255.255.2:9"), ErrPeerNotAllowed)
		if !strings.Contains(err.Error(), "[10.255.255.1 10.7.0.0/16]") || strings.Contains(err.Error(), config.EnvClusterSecret) {
			t.Errorf("message: %v", err)
		}
	})

	t.Run("secret, no allow-list: any host", func(t *testing.T) {
		gen := newInst(t, s, testCfg(), 16, withSecret(testSecret, nil))
		if _, err := gen.t.CheckOpaque(signed(testSecret, "10.255.255.1:9")); err != nil {
			t.Errorf("signed state for another host: %v", err)
		}
	})

	t.Run("secret and allow-list", func(t *testing.T) {
		sender := newInst(t, s, testCfg(), 16, withSecret(testSecret, nil), withPeers("10.0.0.5"))
		gen := newInst(t, s, testCfg(), 16, withSecret(testSecret, nil), withPeers("10.0.0.5"))
		refusedBeforeDial(t, gen, signed(testSecret, "10.255.255.1:9"), ErrPeerNotAllowed)
		if _, err := gen.t.CheckOpaque(signed(testSecret, "10.0.0.5:9")); err != nil {
			t.Errorf("allowed host: %v", err)
		}
		// Loopback is always allowed, both ways: a whole transfer.
		transfer(t, sender, gen, 2, 8, 2, 0, 0)
	})

	t.Run("host names", func(t *testing.T) {
		lookup := func(_ context.Context, host string) ([]netip.Addr, error) {
			if host == "ctx-a.example" {
				return []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("::ffff:10.1.2.4")}, nil
			}
			return nil, errors.New("no such host")
		}
		var logs bytes.Buffer
		gen := newInst(t, s, testCfg(), 16, withPeers("CTX-A.example", "gone.example"), func(o *Options) {
			o.LookupHost = lookup
			o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
		})
		for _, ep := range []string{"10.1.2.3:9", "10.1.2.4:9", "ctx-a.example:9", "gone.example:9"} {
			if _, err := gen.t.CheckOpaque(unsigned(ep)); err != nil {
				t.Errorf("%s: %v", ep, err)
			}
		}
		refusedBeforeDial(t, gen, unsigned("ctx-b.example:9"), ErrPeerNotAllowed)
		for _, want := range []string{"allowed peer host does not resolve", "gone.example", "UNAUTHENTICATED"} {
			if !strings.Contains(logs.String(), want) {
				t.Errorf("the log lacks %q:\n%s", want, logs.String())
			}
		}
	})

	t.Run("the dial itself checks", func(t *testing.T) {
		gen := newInst(t, s, testCfg(), 16)
		if _, _, err := gen.t.ranks[0].ctrl.Dial(context.Background(), "10.255.255.1:9"); !errors.Is(err, ErrPeerNotAllowed) {
			t.Errorf("dial: %v", err)
		}
		if dialedCount(gen) != 0 {
			t.Error("dial recorded a refused endpoint")
		}
	})

	t.Run("bad options", func(t *testing.T) {
		pool, err := kvcache.NewPool(s.RankLayout(0), 4, kvcache.HeapAllocator{})
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		for _, o := range []Options{
			{Secret: []byte("short")},
			{AllowedPeerHosts: []string{"10.0.0.5:80"}},
		} {
			o.State, o.Pools = s, []*kvcache.Pool{pool}
			if tr, err := New(context.Background(), testCfg(), o); err == nil {
				tr.Close()
				t.Errorf("New accepted %+v", o)
			}
		}
	})
}

// TestAcceptAllowList: with an allow-list, a context rank serves control
// connections from loopback and the listed hosts only, and says so at most
// once per interval in its log.
func TestAcceptAllowList(t *testing.T) {
	var logs bytes.Buffer
	p, err := newPeerPolicy(context.Background(), []string{"10.0.0.5", "fd00::/64"}, false, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	open, _ := newPeerPolicy(context.Background(), nil, false, nil, slog.New(slog.DiscardHandler))
	tcp := func(s string) net.Addr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }
	for _, tc := range []struct {
		addr      string
		want, any bool // any: the policy without a list
	}{
		{"127.0.0.1:5000", true, true},
		{"127.3.4.5:5000", true, true},
		{"[::1]:5000", true, true},
		{"10.0.0.5:5000", true, true},
		{"[::ffff:10.0.0.5]:5000", true, true},
		{"10.0.0.6:5000", false, true},
		{"[fd00::9]:5000", true, true},
		{"[fd01::9]:5000", false, true},
	} {
		if got := p.acceptOK(tcp(tc.addr)); got != tc.want {
			t.Errorf("acceptOK(%s) = %v, want %v", tc.addr, got, tc.want)
		}
		if got := open.acceptOK(tcp(tc.addr)); got != tc.any {
			t.Errorf("without a list: acceptOK(%s) = %v, want %v", tc.addr, got, tc.any)
		}
	}
	log := slog.New(slog.NewTextHandler(&logs, nil))
	for range 3 {
		p.logRefusal(log, tcp("10.0.0.6:5000"))
	}
	if n := strings.Count(logs.String(), "refused a control connection"); n != 1 {
		t.Errorf("%d log lines for 3 refusals in a row, want 1:\n%s", n, logs.String())
	}
	if p.suppressed.Load() != 2 {
		t.Errorf("suppressed = %d, want 2", p.suppressed.Load())
	}

	// A context instance with an allow-list still serves loopback.
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, s, testCfg(), 16, withPeers("10.0.0.5"))
	gen := newInst(t, s, testCfg(), 16)
	transfer(t, sender, gen, 3, 8, 3, 0, 0)
}

// TestNonceCache: the replay set is bounded; when full it refuses new states
// (ErrReplayCacheFull) rather than forget unexpired nonces, and frees room as
// nonces expire. CheckOpaque records nothing.
func TestNonceCache(t *testing.T) {
	clk := &fakeClock{}
	peers, _ := newPeerPolicy(context.Background(), nil, true, nil, slog.New(slog.DiscardHandler))
	g := newOpaqueGuard(testSecret, peers, clk.Now, 2)
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	mint := func(ttl time.Duration) *OpaqueState {
		op := &OpaqueState{RequestID: 1, State: s, Endpoints: []string{"127.0.0.1:9"}}
		if err := op.sign(g.key, clk.Now().Add(ttl)); err != nil {
			t.Fatal(err)
		}
		return decodeOpaque(t, marshal(t, op))
	}
	a, b, c := mint(time.Second), mint(time.Minute), mint(time.Minute)
	if err := g.check(a, false); err != nil || g.nonces() != 0 {
		t.Fatalf("check without consume: %v, %d nonces", err, g.nonces())
	}
	for _, op := range []*OpaqueState{a, b} {
		if err := g.check(op, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := g.check(c, true); !errors.Is(err, ErrReplayCacheFull) {
		t.Fatalf("third state with room for two: %v", err)
	}
	if err := g.check(b, true); !errors.Is(err, ErrReplayedOpaqueState) {
		t.Fatalf("replay while full: %v", err)
	}
	clk.Advance(time.Second) // a expires: its nonce is forgotten, c fits
	if err := g.check(c, true); err != nil {
		t.Fatalf("after an expiry: %v", err)
	}
	if err := g.check(a, true); !errors.Is(err, ErrExpiredOpaqueState) {
		t.Fatalf("an expired state whose nonce was forgotten: %v", err)
	}
	if g.nonces() != 2 {
		t.Errorf("%d nonces, bound 2", g.nonces())
	}
}

// TestOpaqueForms: the decoder reads both forms, the signed one round-trips
// with its expiry, nonce and MAC, and every single-byte change of a signed
// state is caught.
func TestOpaqueForms(t *testing.T) {
	key := macKey(testSecret)
	op := sampleOpaque()
	v1 := marshal(t, op)
	if v1[4] != opaqueUnsigned || decodeOpaque(t, v1).Signed {
		t.Fatal("unsigned form")
	}
	exp := time.Now().Add(time.Minute)
	if err := op.sign(key, exp); err != nil {
		t.Fatal(err)
	}
	v2 := marshal(t, op)
	got := decodeOpaque(t, v2)
	if v2[4] != opaqueSigned || !got.Signed || !got.Expiry.Equal(time.UnixMilli(exp.UnixMilli())) || got.Nonce != op.Nonce || got.MAC != op.MAC ||
		!slices.Equal(got.Endpoints, op.Endpoints) || got.Token != op.Token || !got.validMAC(key) {
		t.Fatalf("signed round trip: %+v", got)
	}
	if len(v2) != len(v1)+signedTail {
		t.Errorf("signed form is %d bytes, unsigned %d", len(v2), len(v1))
	}
	again := *op
	if err := again.sign(key, exp); err != nil || again.Nonce == op.Nonce {
		t.Error("two signatures share a nonce")
	}
	for i := range v2 {
		for _, bit := range []byte{0x01, 0x80} {
			b := bytes.Clone(v2)
			b[i] ^= bit
			var o OpaqueState
			if err := o.UnmarshalBinary(b); err == nil && o.Signed && o.validMAC(key) {
				t.Fatalf("flipping bit %#x of byte %d went unnoticed", bit, i)
			}
		}
	}
}

// FuzzOpaqueState fuzzes the signed decoder and its checks: no input panics
// or is accepted by a guard with a secret unless its MAC is right (the
// fuzzer cannot forge one), and a byte changed in a signed state is always
// refused as forged or malformed.
func FuzzOpaqueState(f *testing.F) {
	key := macKey(testSecret)
	op := sampleOpaque()
	op.Endpoints = []string{"127.0.0.1:4000", "127.0.0.1:4001"}
	// Fixed nonce and expiry: every fuzz worker must build the same seed.
	if err := op.signWith(key, time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC), [16]byte{15: 1}); err != nil {
		f.Fatal(err)
	}
	good, _ := op.MarshalBinary()
	f.Add(good, uint16(0), byte(1))
	f.Add(good[:len(good)-1], uint16(7), byte(0x80))
	f.Add([]byte("KVXO\x02"), uint16(4), byte(2))
	unsigned, _ := sampleOpaque().MarshalBinary()
	f.Add(unsigned, uint16(4), byte(3))
	peers, _ := newPeerPolicy(context.Background(), nil, true, nil, slog.New(slog.DiscardHandler))
	f.Fuzz(func(t *testing.T, data []byte, at uint16, flip byte) {
		g := newOpaqueGuard(testSecret, peers, time.Now, 4)
		var o OpaqueState
		if err := o.UnmarshalBinary(data); err == nil {
			err := g.check(&o, true)
			if err == nil && !bytes.Equal(data, good) {
				t.Fatalf("a guard with a secret accepted a state it did not sign: %x", data)
			}
			if err != nil && !errors.Is(err, ErrUnsignedOpaqueState) && !errors.Is(err, ErrForgedOpaqueState) &&
				!errors.Is(err, ErrExpiredOpaqueState) && !errors.Is(err, ErrBadOpaqueState) {
				t.Fatalf("unexpected error class: %v", err)
			}
			again, err := o.MarshalBinary()
			if err != nil {
				t.Fatalf("re-encode: %v", err)
			}
			var o2 OpaqueState
			if err := o2.UnmarshalBinary(again); err != nil || o2.Signed != o.Signed || o2.MAC != o.MAC || o2.Nonce != o.Nonce {
				t.Fatalf("re-decode: %v", err)
			}
		}
		if flip == 0 {
			return
		}
		b := bytes.Clone(good)
		b[int(at)%len(b)] ^= flip
		var t2 OpaqueState
		if err := t2.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrBadOpaqueState) {
				t.Fatalf("decode error without ErrBadOpaqueState: %v", err)
			}
			return
		}
		if err := newOpaqueGuard(testSecret, peers, time.Now, 4).check(&t2, true); !errors.Is(err, ErrForgedOpaqueState) && !errors.Is(err, ErrUnsignedOpaqueState) {
			t.Fatalf("byte %d ^ %#x: %v, want forged or unsigned", int(at)%len(b), flip, err)
		}
	})
}

// TestNonceGivenBackAtLocalRefusal: a signed state that
// RequestAndReceiveAsync refuses for the caller's own mistake, after the
// guard accepted it but before any pull began (blocks for the wrong number
// of ranks, another layout, an id in flight), keeps no nonce: the owner's
// corrected request with the same state pulls it, rather than being told
// that the state was replayed.
func TestNonceGivenBackAtLocalRefusal(t *testing.T) {
	cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	sender := newInst(t, cs, testCfg(), 16, withSecret(testSecret, nil))
	gen := newInst(t, cs, testCfg(), 16, withSecret(testSecret, nil))
	creq, l := startSend(t, sender, 9, 8)
	bad := genReqFor(gen, t, creq, 2)
	bad.Blocks = append(bad.Blocks, nil) // blocks for one rank too many
	if err := gen.t.RequestAndReceiveAsync(bad); err == nil || errors.Is(err, ErrReplayedOpaqueState) {
		t.Fatalf("request with blocks for 2 ranks of 1: %v, want a refusal of its own", err)
	}
	gen.release(t, bad.Blocks)
	if n := gen.t.guard.nonces(); n != 0 {
		t.Errorf("%d nonces kept after a refusal before any pull", n)
	}
	good := genReqFor(gen, t, creq, 2)
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, good); err != nil {
		t.Fatalf("the owner's corrected request with the same state: %v", err)
	}
	gen.verify(t, l, 0, good.Blocks)
	gen.release(t, good.Blocks)
	waitDone(t, creq, 10*time.Second)
	// Pulled: now the state is spent.
	again := genReqFor(gen, t, creq, 2)
	if err := gen.t.RequestAndReceiveAsync(again); !errors.Is(err, ErrReplayedOpaqueState) {
		t.Errorf("the state after its pull: %v, want ErrReplayedOpaqueState", err)
	}
	gen.release(t, again.Blocks)
}
