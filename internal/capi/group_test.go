package capi

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/kvcache"
	"github.com/kvxfer/kvxfer/layout"
)

// openSplit opens one Transceiver per rank of a TP2 instance, as the
// processes of an engine would, in group mode mode.
func openSplit(t *testing.T, mode GroupMode) []*Transceiver {
	t.Helper()
	c := loadTCP(t)
	spec := GroupSpec{Mode: mode, Processes: 2}
	if mode == GroupCoordinated {
		// Below the ephemeral range (package freeport): a port probed with
		// :0 and closed could be taken by any connection's or listener's
		// ephemeral port before the coordinator listens on it again in Open.
		p, err := freeport.Port()
		if err != nil {
			t.Fatal(err)
		}
		spec.Coordinator = net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
	}
	out := make([]*Transceiver, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			s := spec
			s.Process = r
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			out[r], errs[r] = Open(ctx, c, Options{State: desc(2), Ranks: []int{r}, Pools: []PoolSpec{{NumBlocks: 8}}, Group: s, Logger: testLogger(t, fmt.Sprintf("proc%d", r))})
		})
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		t.Cleanup(func() { out[r].Close() })
	}
	return out
}

// testLogger logs to t when KVXFER_TEST_LOG is set (debugging).
func testLogger(t *testing.T, who string) *slog.Logger {
	if os.Getenv("KVXFER_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})).With("who", who)
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// gatherRounds runs the all-gather of the processes' gather groups, as an
// engine's communicator would, until stop is closed.
func gatherRounds(t *testing.T, procs []*Transceiver, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			all := make([][]byte, len(procs))
			for i, p := range procs {
				b, err := p.Outbox()
				if err != nil {
					t.Errorf("outbox %d: %v", i, err)
					return
				}
				all[i] = bytes.Clone(b)
				p.HandedOut()
			}
			for i, p := range procs {
				if err := p.Deliver(all); err != nil {
					t.Errorf("deliver %d: %v", i, err)
					return
				}
			}
			time.Sleep(200 * time.Microsecond)
		}
	})
	return &wg
}

var groupModeNames = map[GroupMode]string{GroupCoordinated: "coordinated", GroupGather: "gather"}

// openSplitRunning is openSplit with, in gather mode, the engine's rounds
// running until the test's end (stopped before the processes close).
func openSplitRunning(t *testing.T, mode GroupMode) []*Transceiver {
	t.Helper()
	procs := openSplit(t, mode)
	if mode == GroupGather {
		stop := make(chan struct{})
		wg := gatherRounds(t, procs, stop)
		t.Cleanup(func() {
			close(stop)
			wg.Wait()
		})
	}
	return procs
}

// TestSplitContextInstance: a TP2 context instance whose ranks are two
// Transceivers (two processes of an engine), in each group mode, sends to
// a TP1 generation instance bit-exact; each process reports the request.
func TestSplitContextInstance(t *testing.T) {
	for _, mode := range []GroupMode{GroupCoordinated, GroupGather} {
		t.Run(groupModeNames[mode], func(t *testing.T) {
			procs := openSplitRunning(t, mode)
			gen := open(t, desc(1), nil, 8)
			st2, _ := desc(2).CacheState()
			const tokens = 20
			l, _ := layout.NewLogical(st2.Shape, tokens)
			l.Fill(3)
			blocks := []kvcache.BlockID{6, 1, 3}
			var opaque []byte
			deadline := time.Now().Add(10 * time.Second)
			for r, p := range procs {
				want, _ := layout.Shard(l, st2, r)
				bb := st2.RankLayout(r).BlockBytes()
				for k, b := range blocks {
					copy(p.PoolMemory(0)[int64(b)*bb:], want[k])
				}
				for {
					op, err := p.RespondAndSend(7, 0, tokens, [][]kvcache.BlockID{blocks})
					if CodeOf(err) == CodeGroup && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond) // the gather group joins at its first round
						continue
					}
					if err != nil {
						t.Fatalf("rank %d: %v", r, err)
					}
					if r == 0 {
						opaque = op
					}
					break
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			genBlocks := []kvcache.BlockID{0, 4, 2}
			if err := gen.RequestAndReceiveSync(ctx, 9, 0, tokens, opaque, [][]kvcache.BlockID{genBlocks}); err != nil {
				t.Fatal(err)
			}
			st1, _ := desc(1).CacheState()
			want, _ := layout.Shard(l, st1, 0)
			bb := st1.RankLayout(0).BlockBytes()
			for k, b := range genBlocks {
				if !bytes.Equal(gen.PoolMemory(0)[int64(b)*bb:int64(b+1)*bb], want[k]) {
					t.Errorf("generation block %d differs from the reference", k)
				}
			}
			for r, p := range procs {
				got, err := p.CheckContextStatus(ctx, 1, 4)
				if err != nil || len(got) != 1 || got[0].ID != 7 || got[0].Code != OK {
					t.Errorf("rank %d status: %+v, %v", r, got, err)
				}
			}
		})
	}
}

// TestSplitContextLateRank: rank 0's process hands its opaque state on at
// once; the generation side's pull reaches rank 1 before rank 1's process
// calls RespondAndSend, 300 ms later, as the processes of an engine do at
// their own pace. Rank 1 holds the pull and serves it when the call comes:
// the cache arrives bit-exact, in each group mode.
func TestSplitContextLateRank(t *testing.T) {
	for _, mode := range []GroupMode{GroupCoordinated, GroupGather} {
		t.Run(groupModeNames[mode], func(t *testing.T) {
			procs := openSplitRunning(t, mode)
			gen := open(t, desc(1), nil, 8)
			st2, _ := desc(2).CacheState()
			const tokens = 20
			l, _ := layout.NewLogical(st2.Shape, tokens)
			l.Fill(4)
			blocks := []kvcache.BlockID{5, 2, 7}
			respond := func(r int) []byte {
				want, _ := layout.Shard(l, st2, r)
				bb := st2.RankLayout(r).BlockBytes()
				for k, b := range blocks {
					copy(procs[r].PoolMemory(0)[int64(b)*bb:], want[k])
				}
				deadline := time.Now().Add(10 * time.Second)
				for {
					op, err := procs[r].RespondAndSend(8, 0, tokens, [][]kvcache.BlockID{blocks})
					if CodeOf(err) == CodeGroup && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond) // the gather group joins at its first round
						continue
					}
					if err != nil {
						t.Fatalf("rank %d: %v", r, err)
					}
					return op
				}
			}
			opaque := respond(0)
			// The state travels to the generation instance (a router, in
			// an engine): long enough for the group's log to carry rank
			// 0's begin to rank 1's process, which is what lets rank 1
			// hold the pull.
			time.Sleep(20 * time.Millisecond)
			genBlocks := []kvcache.BlockID{1, 3, 6}
			if err := gen.RequestAndReceive(10, 0, tokens, opaque, [][]kvcache.BlockID{genBlocks}); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if got, err := gen.CheckGenStatus(ctx, 0, 4); err != nil || len(got) != 0 {
				t.Fatalf("the pull ended before rank 1's call: %+v, %v", got, err)
			}
			respond(1)
			got, err := gen.CheckGenStatus(ctx, 1, 4)
			if err != nil || len(got) != 1 || got[0].ID != 10 || got[0].Code != OK {
				t.Fatalf("pull: %+v, %v (%v)", got, err, gen.RequestError(true, 10))
			}
			st1, _ := desc(1).CacheState()
			want, _ := layout.Shard(l, st1, 0)
			bb := st1.RankLayout(0).BlockBytes()
			for k, b := range genBlocks {
				if !bytes.Equal(gen.PoolMemory(0)[int64(b)*bb:int64(b+1)*bb], want[k]) {
					t.Errorf("generation block %d differs from the reference", k)
				}
			}
			for r, p := range procs {
				got, err := p.CheckContextStatus(ctx, 1, 4)
				if err != nil || len(got) != 1 || got[0].ID != 8 || got[0].Code != OK {
					t.Errorf("rank %d status: %+v, %v", r, got, err)
				}
			}
		})
	}
}

// TestGatherDeliverCodes: a round that is not one (a contribution that
// does not decode) breaks the group with KVXFER_ERR_GROUP, the header's
// code for a group lost or bad, and so does every later round and request.
func TestGatherDeliverCodes(t *testing.T) {
	procs := openSplit(t, GroupGather)
	p := procs[0]
	mine, err := p.Outbox()
	if err != nil {
		t.Fatal(err)
	}
	mine = bytes.Clone(mine)
	p.HandedOut()
	err = p.Deliver([][]byte{mine, []byte("not a contribution")})
	if CodeOf(err) != CodeGroup || !strings.Contains(err.Error(), "contribution of process 1") {
		t.Errorf("a round with a contribution that does not decode: %v (%v), want %v", err, CodeOf(err), CodeGroup)
	}
	if err := p.Deliver([][]byte{mine, mine}); CodeOf(err) != CodeGroup {
		t.Errorf("a round after the group broke: %v (%v), want %v", err, CodeOf(err), CodeGroup)
	}
	if _, err := p.RespondAndSend(1, 0, 8, [][]kvcache.BlockID{{0}}); CodeOf(err) != CodeGroup {
		t.Errorf("a request after the group broke: %v (%v), want %v", err, CodeOf(err), CodeGroup)
	}
}

// TestGatherDeliverMiscount: a deliver of another number of contributions
// than the group has processes is the caller's mistake, refused with
// KVXFER_ERR_INVALID_ARGUMENT before the group sees it: the group is not
// broken, and the rounds that follow make it.
func TestGatherDeliverMiscount(t *testing.T) {
	procs := openSplit(t, GroupGather)
	mine, err := procs[0].Outbox()
	if err != nil {
		t.Fatal(err)
	}
	mine = bytes.Clone(mine)
	err = procs[0].Deliver([][]byte{mine})
	if CodeOf(err) != CodeInvalidArgument || !strings.Contains(err.Error(), "1 contributions, the group has 2 processes") {
		t.Errorf("a round of 1 contribution for 2 processes: %v (%v), want %v", err, CodeOf(err), CodeInvalidArgument)
	}
	stop := make(chan struct{})
	wg := gatherRounds(t, procs, stop)
	defer func() {
		close(stop)
		wg.Wait()
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := procs[0].RespondAndSend(1, 0, 8, [][]kvcache.BlockID{{0}})
		if err == nil {
			return
		}
		if CodeOf(err) != CodeGroup || !strings.Contains(err.Error(), "not joined yet") || time.Now().After(deadline) {
			t.Fatalf("a request after the refused round: %v (%v)", err, CodeOf(err))
		}
		time.Sleep(time.Millisecond)
	}
}
