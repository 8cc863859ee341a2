package bench

import (
	"context"
	"testing"
	"time"
)

// TestProcessPerRank: every rank of both instances is an OS process of its
// own (context TP2 → generation TP1: three processes; and TP1 → TP2 PP2:
// five); the transfers are bit-exact on every generation rank and the
// cost of the cross-process consensus is reported.
func TestProcessPerRank(t *testing.T) {
	for _, c := range []Config{
		{Model: "tiny", CtxTP: 2, GenTP: 1},
		{Model: "tiny", CtxTP: 1, GenTP: 2, GenPP: 2, DType: "fp16"},
	} {
		c.ISL, c.Requests, c.Warmup, c.Concurrency, c.Verify, c.ProcessPerRank = 100, 4, 1, 2, true, true
		c.MaxTokensInBuffer = 32 // several chunks per request
		t.Run("", func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			res, err := Run(ctx, peerCfg(c))
			if err != nil {
				t.Fatal(err)
			}
			if !res.Verified || res.Errors != 0 || res.Requests != 4 || res.Backend != "tcp" || res.Bytes <= 0 || res.PeerLeaked != 0 || res.PeerFailed != 0 {
				t.Fatalf("%+v", res)
			}
			if !res.ProcessPerRank || res.AgreementP50Us <= 0 || res.AgreementP99Us < res.AgreementP50Us ||
				res.CtxAgreementP50Us <= 0 || res.CtxAgreementP99Us < res.CtxAgreementP50Us {
				t.Fatalf("consensus cost not reported: %+v", res)
			}
			t.Logf("consensus per request: generation p50 %.0f µs p99 %.0f µs; context p50 %.0f µs p99 %.0f µs",
				res.AgreementP50Us, res.AgreementP99Us, res.CtxAgreementP50Us, res.CtxAgreementP99Us)
		})
	}
}
