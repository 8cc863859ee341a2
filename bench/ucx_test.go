//go:build ucx

package bench

import (
	"context"
	"strings"
	"testing"

	_ "github.com/kvxfer/kvxfer/transport/ucx"
)

// TestSeparateProcessesUCX: with -tags ucx (make ucx), bench --backend ucx
// and AUTO between two OS processes, bit-exact, carried by ucx (AUTO takes
// shm on one host).
func TestSeparateProcessesUCX(t *testing.T) {
	for _, c := range []Config{
		{Model: "tiny", CtxTP: 2, GenTP: 1, Backend: "ucx"},
		{Model: "tiny", CtxTP: 2, GenTP: 2, Backend: "ucx"}, // identical: direct
		{Model: "tiny", CtxTP: 1, GenTP: 2, Backend: "auto"},
	} {
		c.ISL, c.Requests, c.Warmup, c.Concurrency, c.Verify = 100, 3, 1, 2, true
		c.MaxTokensInBuffer = 32 // several chunks per request
		t.Run(c.Backend, func(t *testing.T) {
			res, err := Run(context.Background(), peerCfg(c))
			if err != nil {
				t.Fatal(err)
			}
			want := map[string]string{"ucx": "ucx", "auto": "shm"}[c.Backend]
			if !res.Verified || res.Errors != 0 || res.Requests != 3 || !strings.HasPrefix(res.Backend, want) || res.Bytes <= 0 || res.PeerLeaked != 0 {
				t.Fatalf("%+v, want carried by %s", res, want)
			}
		})
	}
}
