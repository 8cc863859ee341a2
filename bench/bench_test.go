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
// transfer; the generation request fails, within its deadline, and every
// generation block comes back.
func TestContextProcessKilled(t *testing.T) {
	m, _ := LookupModel("llama-3.1-8b")
	st, err := m.State(kvcache.BF16, 32, 1, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	const tokens = 2048 // 256 MiB
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
	ct.KVTransferTimeoutMs = 5000
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
	blocks, _ := pools[0].Allocate(nb)
	req := &transceiver.Request{ID: 1, Type: transceiver.GenerationOnly, Blocks: [][]kvcache.BlockID{blocks},
		ContextPhase: &transceiver.ContextPhaseParams{OpaqueState: opaque}}
	start := time.Now()
	if err := tr.RequestAndReceiveAsync(req); err != nil {
		t.Fatal(err)
	}
	time.Sleep(30 * time.Millisecond)
	peer.kill()
	done, err := tr.CheckGenTransferStatus(context.Background(), 1)
	if err != nil || len(done) != 1 {
		t.Fatalf("%v %v", done, err)
	}
	if req.State() != transceiver.DisaggTransError {
		t.Skipf("the transfer finished before the kill (%s)", req.State())
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("failed after %v, the deadline was 5s", d)
	}
	if errors.Is(req.Err(), transceiver.ErrTimeout) {
		t.Logf("failed by deadline, not by connection loss: %v", req.Err())
	}
	t.Logf("error after the kill: %v (%v)", req.Err(), time.Since(start))
	pools[0].Release(blocks...)
	if pools[0].FreeBlocks() != nb {
		t.Errorf("%d of %d blocks free", pools[0].FreeBlocks(), nb)
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
