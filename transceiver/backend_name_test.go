package transceiver

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/transport"
)

// namingPlane is a data plane whose name tells whether it has moved
// anything yet, as ucx's does ("ucx(tcp)" once its endpoint is up, "ucx"
// before): "tcp(idle)" until a Send has returned or a receipt has ended,
// "tcp(moved)" after.
type namingPlane struct {
	transport.Transport
	sent atomic.Bool
	mu   sync.Mutex
	rvs  []transport.Recv
}

func (p *namingPlane) Name() string {
	if p.sent.Load() {
		return "tcp(moved)"
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, rv := range p.rvs {
		select {
		case <-rv.Done():
			return "tcp(moved)"
		default:
		}
	}
	return "tcp(idle)"
}

func (p *namingPlane) Send(ctx context.Context, d transport.Descriptor, src [][]byte) error {
	err := p.Transport.Send(ctx, d, src)
	p.sent.Store(true)
	return err
}

func (p *namingPlane) Expect(dst [][]byte) (transport.Recv, error) {
	rv, err := p.Transport.Expect(dst)
	if err == nil {
		p.mu.Lock()
		p.rvs = append(p.rvs, rv)
		p.mu.Unlock()
	}
	return rv, err
}

// TestStatsNameWhatCarried: a transfer's figures name the data plane as
// it names itself once the bytes have moved (ucx says over which of its
// transports only then), on both sides, direct and staged, from the
// first transfer on.
func TestStatsNameWhatCarried(t *testing.T) {
	wrap := func(o *Options) {
		o.WrapDataPlane = func(_ string, tr transport.Transport) transport.Transport { return &namingPlane{Transport: tr} }
	}
	for _, tc := range []struct {
		name     string
		ctx, gen int // TP
		heads    int
	}{
		{"direct", 1, 1, 4},
		{"staged", 4, 1, 4}, // 4 heads over TP4: spans too small for a direct transfer
	} {
		t.Run(tc.name, func(t *testing.T) {
			sender := newInst(t, state(2, tc.heads, 16, 4, kvcache.BF16, tc.ctx, 1, false), testCfg(), 8, wrap)
			gen := newInst(t, state(2, tc.heads, 16, 4, kvcache.BF16, tc.gen, 1, false), testCfg(), 8, wrap)
			st := transfer(t, sender, gen, 1, 16, 7, 0, 0)
			if st.Backend != "tcp(moved)" {
				t.Errorf("generation side: carried by %q, want the name after the move, tcp(moved)", st.Backend)
			}
		})
	}
}
