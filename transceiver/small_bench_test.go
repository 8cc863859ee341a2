package transceiver

import (
	"context"
	"fmt"
	"runtime/metrics"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/kvcache"
)

// BenchmarkSmallTransfer: requests of one 64 KiB block (the tiny model's
// 32 tokens: 4 layers, 4 KV heads of 32, bf16) pulled between two
// instances of one process over loopback, conc at a time: the per-request
// cost of the pull protocol, the driver and the data plane, which the
// bench's small-transfer targets measure between two processes.
// goroutines/transfer counts every goroutine started in the process
// during the loop (both instances', the transports'), per transfer.
func BenchmarkSmallTransfer(b *testing.B) {
	for _, backend := range []config.Backend{config.BackendTCP, config.BackendSHM} {
		for _, conc := range []int{1, 8} {
			b.Run(fmt.Sprintf("%s/conc=%d", backend, conc), func(b *testing.B) {
				benchSmall(b, backend, conc)
			})
		}
	}
}

func benchSmall(b *testing.B, backend config.Backend, conc int) {
	cs := state(4, 4, 32, 32, kvcache.BF16, 1, 1, false)
	cfg := testCfg(func(c *config.CacheTransceiver) { c.Backend = backend })
	sender := newInst(b, cs, cfg, 4*conc)
	gen := newInst(b, cs, cfg, 4*conc)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	creqs := make([]*Request, conc)
	greqs := make([]*Request, conc)
	id := uint64(1)
	var durs []time.Duration
	round := func() {
		for i := range conc {
			cb := sender.alloc(b, 0, 1)
			creqs[i] = &Request{ID: id, Type: ContextOnly, Blocks: cb}
			if err := sender.t.RespondAndSendAsync(creqs[i]); err != nil {
				b.Fatal(err)
			}
			sender.release(b, cb)
			greqs[i] = &Request{ID: id, Type: GenerationOnly, Blocks: gen.alloc(b, 0, 1),
				ContextPhase: &ContextPhaseParams{CtxRequestID: id, OpaqueState: creqs[i].ContextPhase.OpaqueState}}
			id++
		}
		for _, q := range greqs {
			if err := gen.t.RequestAndReceiveAsync(q); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := gen.t.CheckGenTransferStatus(ctx, -1); err != nil {
			b.Fatal(err)
		}
		for _, q := range greqs {
			if q.State() != DisaggGenerationTransComplete {
				b.Fatalf("request %d: %s %v", q.ID, q.State(), q.Err())
			}
			durs = append(durs, q.Stats().Duration)
			gen.release(b, q.Blocks)
		}
		if _, err := sender.t.CheckContextTransferStatus(ctx, -1); err != nil {
			b.Fatal(err)
		}
	}
	round() // dial the connections
	durs = durs[:0]
	b.SetBytes(int64(conc) * sender.pools[0].BlockBytes())
	created := goroutinesCreated()
	for b.Loop() {
		round()
	}
	b.ReportMetric(float64(goroutinesCreated()-created)/float64(b.N*conc), "goroutines/transfer")
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N*conc), "µs/transfer")
	slices.Sort(durs)
	b.ReportMetric(float64(durs[len(durs)/2].Microseconds()), "p50-µs")
}

// goroutinesCreated returns how many goroutines the process has started
// so far (both instances' and the transports', and the benchmark's own).
func goroutinesCreated() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
