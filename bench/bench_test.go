package bench

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
	"github.com/kvxfer/kvxfer/transceiver"
	_ "github.com/kvxfer/kvxfer/transport/shm"
	_ "github.com/kvxfer/kvxfer/transport/tcp"
	"go.uber.org/goleak"
)

// The test binary doubles as the context process: with KVXFER_BENCH_PEER=1
// it runs PeerMain instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv("KVXFER_BENCH_PEER") == "1" {
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		if err := PeerMain(context.Background(), os.Stdin, os.Stdout, config.LoadEnv(os.LookupEnv, os.Environ()), log); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func peerCfg(c Config) Config {
	c.Peer = []string{os.Args[0]}
	c.PeerEnv = []string{"KVXFER_BENCH_PEER=1"}
	return c
}

// TestSeparateProcesses: bit-exact transfers between two OS processes.
func TestSeparateProcesses(t *testing.T) {
	tests := []Config{
		{Model: "tiny", CtxTP: 2, GenTP: 1},
		{Model: "tiny", CtxTP: 1, GenTP: 2, GenPP: 2, DType: "fp16"},
		{Model: "tiny", CtxTP: 2, GenTP: 1, GenPP: 2, MLA: true, DType: "fp8"},
		{Model: "tiny", CtxTP: 2, GenTP: 2}, // identical: zero-copy
	}
	for _, c := range tests {
		c.ISL, c.Requests, c.Warmup, c.Concurrency, c.Verify = 100, 3, 1, 2, true
		c.MaxTokensInBuffer = 32 // several chunks per request
		t.Run("", func(t *testing.T) {
			res, err := Run(context.Background(), peerCfg(c))
			if err != nil {
				t.Fatal(err)
			}
			if !res.Verified || res.Errors != 0 || res.Requests != 3 || res.Backend != "tcp" || res.Bytes <= 0 || res.PeerLeaked != 0 {
				t.Fatalf("%+v", res)
			}
		})
	}
}

// TestContextProcessKilled: the context process dies in the middle of a
// transfer; the generation request fails at once with a peer-loss error
// (DESIGN.md: a lost connection fails every transfer on it at once with a
// typed error), not at its deadline, and the generation pool ends where it
// started: the transceiver holds none of the request's blocks.
func TestContextProcessKilled(t *testing.T) {
	m, _ := LookupModel("llama-3.1-8b")
	st, err := m.State(kvcache.BF16, 32, 1, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	const tokens = 2048 // 256 MiB
	const timeout = 5 * time.Second
	// lossBound is how soon after the kill the failure must come: far below
	// the deadline (the socket tells at once; it takes ~150 ms under -race).
	const lossBound = timeout / 5
	nb := layout.NumBlocks(tokens, 32)
	c := peerCfg(Config{Backend: "tcp"})
	c.defaults()
	peer, err := startPeer(context.Background(), c, peerSetup{Backend: "tcp", PoolBlocks: nb}, &st)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.stop()
	opaque, err := peer.prepare(1, tokens, 1)
	if err != nil {
		t.Fatal(err)
	}
	ct, _ := config.NewCacheTransceiver("tcp", 32, config.Env{})
	ct.KVTransferTimeoutMs = int(timeout / time.Millisecond)
	ct.TransferBufferSize = 1 << 20 // many small chunks: the transfer takes a while
	pools, err := newPools(st, nb, kvcache.HeapAllocator{})
	if err != nil {
		t.Fatal(err)
	}
	defer closePools(pools)
	tr, err := transceiver.New(context.Background(), ct, transceiver.Options{State: st, Pools: pools})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	before := pools[0].Stats()
	blocks, err := pools[0].Allocate(nb)
	if err != nil {
		t.Fatal(err)
	}
	req := &transceiver.Request{ID: 1, Type: transceiver.GenerationOnly, Blocks: [][]kvcache.BlockID{blocks},
		ContextPhase: &transceiver.ContextPhaseParams{OpaqueState: opaque}}
	if err := tr.RequestAndReceiveAsync(req); err != nil {
		t.Fatal(err)
	}
	time.Sleep(30 * time.Millisecond)
	peer.kill()
	killed := time.Now()
	done, err := tr.CheckGenTransferStatus(context.Background(), 1)
	if err != nil || len(done) != 1 {
		t.Fatalf("%v %v", done, err)
	}
	took := time.Since(killed)
	if req.State() != transceiver.DisaggTransError {
		t.Skipf("the transfer finished before the kill (%s)", req.State())
	}
	// The control connection or a data connection may see the loss first;
	// either way the request fails with ErrPeerLost.
	if err := req.Err(); errors.Is(err, transceiver.ErrTimeout) || !errors.Is(err, transceiver.ErrPeerLost) {
		t.Errorf("failed with %v, want a peer-loss error", err)
	}
	if took > lossBound {
		t.Errorf("failed %v after the kill, want within %v (the deadline is %v)", took, lossBound, timeout)
	}
	t.Logf("error %v after the kill: %v", took, req.Err())
	// Only the owner's pin is left: the transceiver holds no block.
	if s := pools[0].Stats(); s.Pinned != before.Pinned+nb {
		t.Errorf("after the failure: %d blocks pinned, want the owner's %d (%d before)", s.Pinned, nb, before.Pinned)
	}
	if err := pools[0].Release(blocks...); err != nil {
		t.Fatal(err)
	}
	if s := pools[0].Stats(); s.Available() != before.Available() || s.Pinned != before.Pinned {
		t.Errorf("after release: %d available, %d pinned; %d and %d before", s.Available(), s.Pinned, before.Available(), before.Pinned)
	}
}

func TestModels(t *testing.T) {
	for _, tc := range []struct {
		name     string
		perToken int64
		tp, pp   int
		mla      bool
	}{
		{"llama-3.1-8b", 128 << 10, 1, 1, false},
		{"llama-3.1-70b", 320 << 10, 8, 1, false},
		{"deepseek-v3", 61 * 576 * 2, 1, 1, true},
	} {
		m, err := LookupModel(tc.name)
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.State(kvcache.BF16, 32, tc.tp, tc.pp, false)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Shape.BytesPerToken(); got != tc.perToken {
			t.Errorf("%s: %d bytes per token, want %d", tc.name, got, tc.perToken)
		}
		if (s.Attention == layout.AttentionMLA) != tc.mla {
			t.Errorf("%s: attention %v", tc.name, s.Attention)
		}
	}
	if _, err := LookupModel("gpt-5"); err == nil {
		t.Error("unknown model accepted")
	}
}
