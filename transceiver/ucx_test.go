//go:build ucx

package transceiver

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	_ "github.com/kvxfer/kvxfer/transport/ucx"
)

// With -tags ucx (make ucx), every pairing also runs over UCX.
func init() { pairingBackends = append(pairingBackends, config.BackendUCX) }

// TestAutoPicksUCXAcrossHosts: AUTO between ranks that are not on one host
// (their hello says so) skips shm and takes ucx, which this binary has,
// before tcp; on one host it still takes shm.
func TestAutoPicksUCXAcrossHosts(t *testing.T) {
	s := state(2, 2, 16, 4, kvcache.BF16, 1, 1, false)
	auto := testCfg(func(c *config.CacheTransceiver) { c.Backend = config.BackendAuto })
	sender := newInst(t, s, auto, 16, func(o *Options) { o.Host = "host-a" })
	gen := newInst(t, s, auto, 16, func(o *Options) { o.Host = "host-b" })
	if st := transfer(t, sender, gen, 1, 40, 1, 0, 0); !strings.HasPrefix(st.Backend, "ucx") {
		t.Errorf("AUTO across hosts: %q, want ucx", st.Backend)
	}
	near := newInst(t, s, auto, 16, func(o *Options) { o.Host = "host-a" })
	if st := transfer(t, sender, near, 2, 40, 2, 0, 0); st.Backend != "shm" {
		t.Errorf("AUTO on one host: %q, want shm", st.Backend)
	}
}
