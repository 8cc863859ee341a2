package capi

import (
	"context"
	"testing"

	"github.com/kvxfer/kvxfer/kvcache"
)

// BenchmarkRespondAndStatus is the Go side of the binding's host overhead
// per request (python/benchmarks/overhead.py): a context request handed
// over and a status call that does not wait; no data moves. The requests
// stay held until the end.
func BenchmarkRespondAndStatus(b *testing.B) {
	c, err := LoadConfig("bench.yaml", []byte(tcpYAML), noEnv())
	if err != nil {
		b.Fatal(err)
	}
	d := StateDesc{Layers: 1, KVHeads: 1, HeadDim: 8, TokensPerBlock: 2, DType: kvcache.FP16, TP: 1, PP: 1}
	tr, err := Open(context.Background(), c, Options{State: d, Pools: []PoolSpec{{NumBlocks: 64}}})
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Close()
	id := uint64(0)
	blocks := [][]kvcache.BlockID{{0}}
	for b.Loop() {
		id++
		blocks[0][0] = kvcache.BlockID(id % 64)
		if _, err := tr.RespondAndSend(id, 0, 2, blocks); err != nil {
			b.Fatal(err)
		}
		if _, err := tr.CheckContextStatus(context.Background(), 0, 16); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	for i := uint64(1); i <= id; i++ {
		tr.Cancel(i)
	}
}
