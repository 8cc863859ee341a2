//go:build ucx && cgo

package ucx

import (
	"context"
	"encoding/base64"
	"os"
	"strings"
	"syscall"
	"testing"
)

// BenchmarkSend moves one message at a time between two transports of this
// process: Expect, Send, wait for the receipt. "thp" memory is anonymous
// memory with MADV_HUGEPAGE, as ucx_perftest's (ucp_mem_map allocates
// transparent huge pages): the cma copy of a 4 KiB-page buffer costs about
// twice as much. "goheap" is make([]byte). Compare with ucx_perftest's
// tag_bw at the same size and UCX_TLS: see the package documentation.
func BenchmarkSend(b *testing.B) {
	for _, sz := range []struct {
		name string
		n    int
	}{{"4MiB", 4 << 20}, {"512MiB", 512 << 20}} {
		for _, mem := range []string{"thp", "goheap"} {
			b.Run(sz.name+"/"+mem, func(b *testing.B) {
				a, r := open(b), open(b)
				defer a.Close()
				defer r.Close()
				src, dst := alloc(b, mem, sz.n), alloc(b, mem, sz.n)
				fillPattern(1, src)
				clear(dst)
				send := func() {
					rv, err := r.Expect([][]byte{dst})
					if err != nil {
						b.Fatal(err)
					}
					if err := a.Send(context.Background(), rv.Descriptor(), [][]byte{src}); err != nil {
						b.Fatal(err)
					}
					<-rv.Done()
					if err := rv.Err(); err != nil {
						b.Fatal(err)
					}
				}
				send() // connect and warm up
				b.SetBytes(int64(sz.n))
				for b.Loop() {
					send()
				}
				b.ReportMetric(0, "ns/op")
				b.Logf("%s", a.Name())
			})
		}
	}
}

// BenchmarkSendProcess is BenchmarkSend with the receiver in another
// process (this test binary as a peer), as ucx_perftest runs: the sender
// waits for each message's descriptor over a pipe from the receiver, which
// posts its next receipt when the last one is done. Both sides use the
// same kind of memory. "512MiB_4MiBx128" cuts both sides into 4 MiB
// segments, the pool blocks of llama-3.1-8b at 32 tokens, as kvxfer bench
// moves a 4096-token request (128 messages, all in flight); compare it
// with kvxfer bench --baseline's ucx_c setting "4 MiB x 128 in flight".
// "512MiB_16MiBx32" is the same bytes in 16 MiB segments, the message size
// of ucx_c's usual best setting (16 MiB x 8 in flight).
func BenchmarkSendProcess(b *testing.B) {
	for _, sz := range []struct {
		name string
		n    int
		seg  int // 0: one segment
	}{{"4MiB", 4 << 20, 0}, {"512MiB", 512 << 20, 0}, {"512MiB_4MiBx128", 512 << 20, 4 << 20}, {"512MiB_16MiBx32", 512 << 20, 16 << 20}} {
		for _, mem := range []string{"thp", "goheap"} {
			b.Run(sz.name+"/"+mem, func(b *testing.B) {
				var env []string
				if v, ok := os.LookupEnv("UCX_TLS"); ok {
					env = append(env, "UCX_TLS="+v)
				}
				p := startPeer(b, env...)
				a := open(b)
				defer a.Close()
				src := alloc(b, mem, sz.n)
				fillPattern(1, src)
				p.cmdf(b, "sink %d %s %d", sz.n, mem, sz.seg)
				send := func() {
					desc, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(p.expect(b, "desc "), "desc "))
					if err != nil {
						b.Fatal(err)
					}
					if err := a.Send(context.Background(), desc, cut(src, sz.seg)); err != nil {
						b.Fatal(err)
					}
				}
				send()
				b.SetBytes(int64(sz.n))
				for b.Loop() {
					send()
				}
				b.ReportMetric(0, "ns/op")
				b.Logf("%s", a.Name())
			})
		}
	}
}

// BenchmarkSendBlocks moves 256 blocks of 2 MiB (512 MiB, a Llama-3.1-8B
// prompt of 4k tokens) cut the same on both sides: 256 zero-copy messages.
func BenchmarkSendBlocks(b *testing.B) {
	a, r := open(b), open(b)
	defer a.Close()
	defer r.Close()
	const blocks, block = 256, 2 << 20
	smem, dmem := alloc(b, "thp", blocks*block), alloc(b, "thp", blocks*block)
	fillPattern(1, smem)
	clear(dmem)
	src := make([][]byte, blocks)
	dst := make([][]byte, blocks)
	for i := range src {
		src[i] = smem[i*block : (i+1)*block]
		dst[i] = dmem[i*block : (i+1)*block]
	}
	send := func() {
		rv, err := r.Expect(dst)
		if err != nil {
			b.Fatal(err)
		}
		if err := a.Send(context.Background(), rv.Descriptor(), src); err != nil {
			b.Fatal(err)
		}
		<-rv.Done()
		if err := rv.Err(); err != nil {
			b.Fatal(err)
		}
	}
	send()
	b.SetBytes(blocks * block)
	for b.Loop() {
		send()
	}
	b.ReportMetric(0, "ns/op")
}

// alloc returns n bytes of "thp" or "goheap" memory, freed at the end of b.
func alloc(b *testing.B, mem string, n int) []byte {
	if mem == "goheap" {
		return make([]byte, n)
	}
	m, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		b.Fatal(err)
	}
	const madvHugepage = 14 // MADV_HUGEPAGE
	if err := syscall.Madvise(m, madvHugepage); err != nil {
		b.Logf("madvise(MADV_HUGEPAGE): %v", err)
	}
	b.Cleanup(func() { syscall.Munmap(m) })
	return m
}
