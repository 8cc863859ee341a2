package transceiver

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transport"
)

// newInstTLS is newInst with mutual TLS (tc, nil for none) and a logger.
func newInstTLS(t *testing.T, state layout.CacheState, cfg *config.CacheTransceiver, blocksPerRank int, tc *transport.TLSConfig, log *slog.Logger) *inst {
	t.Helper()
	in := &inst{state: state}
	for r := range state.Parallel.NumRanks() {
		p, err := kvcache.NewPool(state.RankLayout(r), blocksPerRank, PoolAllocator(cfg))
		if err != nil {
			t.Fatal(err)
		}
		in.pools = append(in.pools, p)
		in.free = append(in.free, p.FreeBlocks())
	}
	tr, err := New(context.Background(), cfg, Options{State: state, Pools: in.pools, Logger: log, TLS: tc})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	in.t = tr
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		stagingFreed(t, tr)
		for r, p := range in.pools {
			if got := p.FreeBlocks(); got != in.free[r] {
				t.Errorf("rank %d: %d free blocks at the end, %d at the start", r, got, in.free[r])
			}
			p.Close()
		}
	})
	return in
}

func tlsParty(t *testing.T, ca *tlsconf.Authority, name string) *transport.TLSConfig {
	t.Helper()
	c, err := ca.Party(name, nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return c.Transport()
}

// TestTLSTransfer: with mutual TLS on both sides, a heterogeneous transfer
// (TP2 -> TP1, chunked) is bit-exact and carried by tcp over TLS.
func TestTLSTransfer(t *testing.T) {
	ca, err := tlsconf.NewAuthority("transceiver test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cs := state(2, 4, 16, 8, kvcache.BF16, 2, 1, false)
	gs := state(2, 4, 16, 8, kvcache.BF16, 1, 1, false)
	sender := newInstTLS(t, cs, testCfg(), 16, tlsParty(t, ca, "sender"), testLogger(t))
	gen := newInstTLS(t, gs, testCfg(), 16, tlsParty(t, ca, "gen"), testLogger(t))
	st := transfer(t, sender, gen, 1, 100, 7, 0, 0)
	if st.Backend != "tcp(tls)" {
		t.Errorf("carried by %q, want tcp(tls)", st.Backend)
	}
}

// TestTLSRefused: a context instance with TLS refuses generation ranks
// without a certificate of its CA (plain TCP, another CA) with a log line
// that says why, and still serves the request to a member of its cluster;
// a generation rank with TLS refuses a context rank without it.
func TestTLSRefused(t *testing.T) {
	ca, err := tlsconf.NewAuthority("transceiver test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	other, err := tlsconf.NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	st := state(2, 4, 16, 8, kvcache.BF16, 1, 1, false)
	var logs syncbuf.Buffer
	sender := newInstTLS(t, st, testCfg(), 16, tlsParty(t, ca, "sender"), slog.New(slog.NewTextHandler(&logs, nil)))

	l, err := layout.NewLogical(st.Shape, 64)
	if err != nil {
		t.Fatal(err)
	}
	l.Fill(3)
	nb := layout.NumBlocks(64, st.Shape.TokensPerBlock)
	cb := sender.alloc(t, 0, nb)
	sender.fill(t, l, 0, cb)
	creq := &Request{ID: 1, Type: ContextOnly, Blocks: cb}
	if err := sender.t.RespondAndSendAsync(creq); err != nil {
		t.Fatal(err)
	}
	sender.release(t, cb)

	// pull pulls the context request into gen; the caller releases the
	// blocks of the returned request.
	pull := func(t *testing.T, gen *inst, id uint64) (*Request, error) {
		gb := gen.alloc(t, 0, nb)
		greq := &Request{ID: id, Type: GenerationOnly, Blocks: gb,
			ContextPhase: &ContextPhaseParams{CtxRequestID: creq.ContextPhase.CtxRequestID, OpaqueState: creq.ContextPhase.OpaqueState}}
		cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		return greq, gen.t.RequestAndReceiveSync(cctx, greq)
	}
	stranger := tlsParty(t, other, "stranger")
	// A certificate of another CA, but trusting ours: the context side
	// is the one to refuse.
	intruder := &transport.TLSConfig{Server: stranger.Server, Client: tlsParty(t, ca, "x").Client.Clone()}
	intruder.Client.Certificates = nil
	intruder.Client.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &stranger.Client.Certificates[0], nil // sent although the server asks for our CA
	}
	for i, tc := range []struct {
		name string
		tls  *transport.TLSConfig
		want string // in the generation side's error
	}{
		{"plain generation rank", nil, "handshake"},
		{"generation rank of another CA", stranger, "certificate signed by unknown authority"},
		{"client certificate of another CA", intruder, "remote error: tls: unknown certificate authority"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := strings.Count(logs.String(), "refused a control connection")
			gen := newInstTLS(t, st, testCfg(), 16, tc.tls, testLogger(t))
			greq, err := pull(t, gen, uint64(100+i))
			gen.release(t, greq.Blocks)
			if err == nil || !errors.Is(err, ErrPeerLost) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("pull = %v, want ErrPeerLost mentioning %q", err, tc.want)
			}
			// The context side's reader logs the refusal on its own time.
			deadline := time.Now().Add(5 * time.Second)
			for strings.Count(logs.String(), "refused a control connection: TLS handshake failed") <= before {
				if time.Now().After(deadline) {
					t.Fatalf("the context side did not log the refusal:\n%s", logs.String())
				}
				time.Sleep(5 * time.Millisecond) // polling a log: no event to wait on
			}
		})
	}
	if creq.State() != DisaggContextTransInProgress {
		t.Fatalf("context request %s after refused peers, want still held", creq.State())
	}
	gen := newInstTLS(t, st, testCfg(), 16, tlsParty(t, ca, "gen"), testLogger(t))
	greq, err := pull(t, gen, 200)
	if err != nil {
		t.Fatalf("member's pull after the refusals: %v", err)
	}
	gen.verify(t, l, 0, greq.Blocks)
	gen.release(t, greq.Blocks)
	waitDone(t, creq, 10*time.Second)
	if creq.State() != DisaggContextComplete {
		t.Errorf("context request %s, want complete", creq.State())
	}

	t.Run("context rank without TLS", func(t *testing.T) {
		plain := newInstTLS(t, st, testCfg(), 16, nil, testLogger(t))
		cb := plain.alloc(t, 0, nb)
		req := &Request{ID: 9, Type: ContextOnly, Blocks: cb}
		if err := plain.t.RespondAndSendAsync(req); err != nil {
			t.Fatal(err)
		}
		plain.release(t, cb)
		defer plain.t.Cancel(req)
		creq = req
		greq, err := pull(t, gen, 300)
		gen.release(t, greq.Blocks)
		if err == nil || !strings.Contains(err.Error(), "TLS handshake with context rank") {
			t.Fatalf("pull from a plain context rank = %v, want a TLS handshake error", err)
		}
	})
}

// TestTLSRefusalFloodLogBounded: strangers that open plain connections to
// a control listener with TLS, write a line and wait, are each refused at
// the handshake, but buy no log line per connection: the refusals are
// logged as the connection caps' are, a line a second with the count left
// out.
func TestTLSRefusalFloodLogBounded(t *testing.T) {
	const flood = 200
	ca, err := tlsconf.NewAuthority("transceiver test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	st := state(2, 4, 16, 8, kvcache.BF16, 1, 1, false)
	var logs syncbuf.Buffer
	sender := newInstTLS(t, st, testCfg(), 16, tlsParty(t, ca, "sender"), slog.New(slog.NewTextHandler(&logs, nil)))
	ep := sender.t.Endpoints()[0]
	for i := range flood {
		c, err := net.DialTimeout("tcp", ep, 5*time.Second)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
		_, err = io.Copy(io.Discard, c) // until the listener closes it: its refusal is logged by then
		c.Close()
		if err != nil {
			t.Fatalf("connection %d: not closed by the listener: %v", i, err)
		}
	}
	if n := strings.Count(logs.String(), "TLS handshake failed"); n == 0 || n > 3 {
		t.Errorf("%d log lines for %d refused TLS handshakes, want 1 to 3", n, flood)
	}
}
