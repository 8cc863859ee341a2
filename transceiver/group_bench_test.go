package transceiver

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

// BenchmarkGroupLog: one event published by a process and applied by every
// process of a group of four, one at a time: the latency of the instance's
// log, what a request's completion waits for in a split instance.
func BenchmarkGroupLog(b *testing.B) {
	for _, mode := range groupModes {
		b.Run(mode.name, func(b *testing.B) {
			const n = 4
			groups, drive, _ := mode.make(b, n)
			drive()
			members := make([]*countMember, n)
			var wg sync.WaitGroup
			for p := range n {
				members[p] = &countMember{applied: make(chan struct{}, 1<<16)}
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					if err := groups[p].start(ctx, members[p], groupJoin{ranks: []int{p}, endpoints: []string{fmt.Sprint("e", p)}}); err != nil {
						b.Error(err)
					}
				}()
			}
			wg.Wait()
			ev := attemptEndEvent{key: instKey{sideSend, 1}, rank: 1, attempt: 1}
			enc, _ := encodeBatch(1, []instEvent{ev})
			b.SetBytes(int64(len(enc)))
			i := 0
			for b.Loop() {
				groups[i%n].publish(ev)
				for _, m := range members {
					<-m.applied
				}
				i++
			}
			b.StopTimer()
			for _, g := range groups {
				g.close()
			}
		})
	}
}

// countMember signals each event applied.
type countMember struct{ applied chan struct{} }

func (m *countMember) joined([]groupJoin) error { return nil }
func (m *countMember) lost(err error) instEvent { return ranksLostEvent{err: err} }
func (m *countMember) apply(evs []instEvent) {
	for range evs {
		m.applied <- struct{}{}
	}
}

// BenchmarkEncodeBatch: a batch of the log of 64 events, encoded and
// decoded.
func BenchmarkEncodeBatch(b *testing.B) {
	var evs []instEvent
	for i := range 64 {
		evs = append(evs, sampleEvents()[i%len(sampleEvents())])
	}
	enc, err := encodeBatch(3, evs)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(enc)))
	for b.Loop() {
		m, _ := encodeBatch(3, evs)
		if _, err := decodeGroupMsg(m); err != nil {
			b.Fatal(err)
		}
	}
}
