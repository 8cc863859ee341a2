package transceiver

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// TestDataCheck: where a context rank may send a generation peer's data,
// whatever host the peer's descriptor names.
func TestDataCheck(t *testing.T) {
	lookup := func(context.Context, string) ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("10.2.0.7")}, nil
	}
	for _, tc := range []struct {
		name   string
		list   []string
		secret bool
		host   string
		peer   string
		ok     bool
	}{
		{"the peer's own address", nil, false, "10.0.0.5", "10.0.0.5", true},
		{"the peer's own address, mapped", nil, false, "10.0.0.5", "::ffff:10.0.0.5", true},
		{"the peer's own IPv6 address", nil, false, "[fd00::5]", "fd00::5", true},
		{"another host", nil, false, "10.0.0.6", "10.0.0.5", false},
		{"another host, with a secret and no list", nil, true, "192.0.2.1", "10.0.0.5", false},
		{"this host's loopback, for a remote peer", nil, false, "127.0.0.1", "10.0.0.5", false},
		{"this host's localhost, for a remote peer", nil, true, "localhost", "10.0.0.5", false},
		{"unspecified, for a remote peer", nil, false, "0.0.0.0", "10.0.0.5", false},
		{"loopback, for a local peer", nil, false, "127.0.0.2", "127.0.0.1", true},
		{"localhost, for a local peer", nil, false, "localhost", "127.0.0.1", true},
		{"unspecified, for a local peer", nil, false, "::", "127.0.0.1", true},
		{"a remote host, for a local peer", nil, false, "192.0.2.1", "127.0.0.1", false},
		{"on the list by prefix", []string{"10.1.0.0/16"}, false, "10.1.2.3", "10.0.0.5", true},
		{"on the list by name", []string{"gen-a.example"}, false, "GEN-A.example.", "10.0.0.5", true},
		{"on the list by the name's address", []string{"gen-a.example"}, false, "10.2.0.7", "10.0.0.5", true},
		{"a name not on the list", []string{"gen-a.example"}, false, "gen-b.example", "10.0.0.5", false},
		{"control connection gone", nil, false, "127.0.0.1", "", false},
		{"a zoned address", nil, true, "fe80::1%eth0", "10.0.0.5", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := newPeerPolicy(context.Background(), tc.list, tc.secret, lookup, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			err = p.dataCheck(tc.host, tc.peer)
			if tc.ok {
				if err != nil {
					t.Errorf("dataCheck(%q, peer %q) = %v, want nil", tc.host, tc.peer, err)
				}
				return
			}
			if !errors.Is(err, ErrPeerNotAllowed) || !errors.Is(err, transport.ErrBadDescriptor) || !strings.Contains(err.Error(), tc.host) {
				t.Errorf("dataCheck(%q, peer %q) = %v, want ErrPeerNotAllowed and ErrBadDescriptor naming the host", tc.host, tc.peer, err)
			}
		})
	}
}

// withEndpoint returns a tcp descriptor like desc that names endpoint.
func withEndpoint(t *testing.T, desc transport.Descriptor, old, endpoint string) transport.Descriptor {
	t.Helper()
	i := bytes.Index(desc, []byte(old))
	if i < 1 || int(desc[i-1]) != len(old) {
		t.Fatalf("no length-prefixed endpoint %q in descriptor %x", old, desc)
	}
	out := append([]byte{}, desc[:i-1]...)
	out = append(out, byte(len(endpoint)))
	out = append(out, endpoint...)
	return append(out, desc[i+len(old):]...)
}

// TestHostileDataEndpoint: a generation peer that holds a request's
// token (any client of the context worker's API gets its own) cannot have
// the context rank connect to a host of its choosing by naming it in the
// descriptor of its request-info: the send is refused before any dial,
// and the request is still pulled by its owner.
func TestHostileDataEndpoint(t *testing.T) {
	cs := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	var logs syncbuf.Buffer
	sender := newInst(t, cs, testCfg(), 16, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(&logs, nil)) })
	gen := newInst(t, cs, testCfg(), 16)
	creq, l := startSend(t, sender, 9, 8)
	var op OpaqueState
	if err := op.UnmarshalBinary(creq.ContextPhase.OpaqueState); err != nil {
		t.Fatal(err)
	}
	// A genuine descriptor of the request's size, on the generation
	// instance's tcp plane, made to name a host that is not the peer's.
	tr := gen.t.ranks[0].transports["tcp"]
	rv, err := tr.Expect([][]byte{make([]byte, 2*cs.RankLayout(0).BlockBytes())})
	if err != nil {
		t.Fatal(err)
	}
	defer rv.Cancel()
	desc := withEndpoint(t, rv.Descriptor(), tr.Endpoint(), "192.0.2.1:9")

	st, _ := cs.MarshalBinary()
	c := hostileHello(t, sender.t.Endpoints()[0], "127.0.0.1", st)
	if c == nil {
		t.Fatal("the hostile hello was refused")
	}
	defer c.Close()
	ri := &wire.RequestInfo{CtxRequestID: creq.ID, GenRequestID: 1, Token: op.Token, GenState: st, NumBlocks: 2, Backend: "tcp", Desc: desc}
	b, _ := wire.Append(nil, ri)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the send refused", func() bool {
		return strings.Contains(logs.String(), "peer not allowed")
	})
	if s := logs.String(); !strings.Contains(s, "192.0.2.1") || strings.Contains(s, "dial tcp 192.0.2.1") {
		t.Errorf("sender's log does not name the refused host, or shows a dial to it:\n%s", s)
	}
	go func() { // the hostile side reads whatever it is told, so that no write blocks
		br := bufio.NewReader(c)
		for {
			if _, err := wire.Read(br); err != nil {
				return
			}
		}
	}()

	gb := genReqFor(gen, t, creq, 2)
	cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := gen.t.RequestAndReceiveSync(cctx, gb); err != nil {
		t.Fatalf("the owner's pull after the refused one: %v", err)
	}
	gen.verify(t, l, 0, gb.Blocks)
	gen.release(t, gb.Blocks)
	waitDone(t, creq, 10*time.Second)
}
