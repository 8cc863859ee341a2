package bench

import (
	"context"
	"fmt"
	"strings"
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

// TestRankProcessKilled: a context rank's process is killed (SIGKILL)
// while a request is held for the generation side, the coordinator's
// (rank 0) or another's; the request fails on the other context process
// at once, with the group's loss, not at its 60 s deadline.
func TestRankProcessKilled(t *testing.T) {
	c := peerCfg(Config{Model: "tiny", CtxTP: 2, GenTP: 1, ISL: 64, Concurrency: 1})
	c.defaults()
	_, cs, _, err := c.states()
	if err != nil {
		t.Fatal(err)
	}
	for _, killed := range []int{1, 0} {
		t.Run(fmt.Sprint("rank ", killed), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			procs, err := startInstance(ctx, &c, "context", cs, peerSetup{Backend: "tcp", PoolBlocks: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer procs.stop()
			if _, err := procs.all(peerMsg{Op: "prepare", ID: 1, Tokens: 64, Seed: 1}); err != nil {
				t.Fatal(err)
			}
			survivor := procs[1-killed]
			start := time.Now()
			procs[killed].kill()
			if err := survivor.send(peerMsg{Op: "wait", Tokens: 5000}); err != nil {
				t.Fatal(err)
			}
			m, err := survivor.read()
			if err != nil {
				t.Fatal(err)
			}
			took := time.Since(start)
			if m.Error != "" || len(m.Results) != 1 || m.Results[0].ID != 1 || !strings.Contains(m.Results[0].Error, "instance group lost") {
				t.Fatalf("after rank %d's process died, the other's: %+v", killed, m)
			}
			if took > 2*time.Second {
				t.Fatalf("the loss took %v to fail the request", took)
			}
			t.Logf("the request failed %v after the process was killed: %s", took, m.Results[0].Error)
		})
	}
}
