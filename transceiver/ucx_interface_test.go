package transceiver

import (
	"testing"

	"github.com/kvxfer/kvxfer/config"
)

// TestUCXInterfaceSetting: TRTLLM_UCX_INTERFACE reaches the ranks' settings
// (and so the ucx data plane's transport.Options.Interface) when the
// backend is UCX or AUTO, and only then.
func TestUCXInterfaceSetting(t *testing.T) {
	cfg := testCfg(func(c *config.CacheTransceiver) { c.UCXInterface = "lo" })
	for _, tc := range []struct {
		backend config.Backend
		want    string
	}{
		{config.BackendUCX, "lo"}, {config.BackendAuto, "lo"}, {config.BackendTCP, ""}, {config.BackendSHM, ""},
	} {
		if got := settingsOf(cfg, &Options{}, tc.backend, nil, nil).ucxInterface; got != tc.want {
			t.Errorf("backend %s: interface %q, want %q", tc.backend, got, tc.want)
		}
	}
}
