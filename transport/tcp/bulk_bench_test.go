package tcp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/hugepage"
	"github.com/kvxfer/kvxfer/transport"
)

// The test binary, run with bulkPeerEnv set, is the sending process of
// BenchmarkBulkProcess: it opens a tcp Transport for each stream count of
// bulkStreams, allocates and fills two sources of bulkBytes (one in 4 KiB
// pages, one advised to huge pages before it is touched), prints the
// address it listens on, accepts a control connection and answers each
// control message of ctlLen bytes:
//
//	't' s p n desc: Sends source p (0: 4 KiB pages, 1: huge pages), cut
//	     into bulkBlock pieces as a pool's blocks are, over the Transport
//	     of bulkStreams[s], to the receipt of the n-byte descriptor desc;
//	'w' p: writes source p on the control connection, bulkBlock bytes per
//	     Write (the plain loop tcp is compared with).
//
// It exits when the control connection ends.
const (
	bulkPeerEnv = "KVXFER_TCP_BULK_PEER"
	bulkBlock   = 4 << 20 // a llama-3.1-8b block of 32 tokens, bf16
	bulkBytes   = 512 << 20
)

var bulkStreams = []int{1, 2, 4}

// bulkMem allocates bulkBytes in blocks of bulkBlock, advised to huge
// pages before they are first touched when huge is set.
func bulkMem(huge bool) ([]byte, [][]byte) {
	mem := make([]byte, bulkBytes)
	if huge {
		hugepage.Advise(mem)
	}
	var blocks [][]byte
	for off := 0; off < len(mem); off += bulkBlock {
		blocks = append(blocks, mem[off:off+bulkBlock])
	}
	return mem, blocks
}

func bulkWord(i int) uint64 { return uint64(i) * 0x9e3779b97f4a7c15 }

// bulkPeerMain runs the sending process and returns its exit code.
func bulkPeerMain() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "bulk peer:", err); return 1 }
	var trs []*Transport
	for _, s := range bulkStreams {
		tr, err := Open(context.Background(), transport.Options{Streams: s})
		if err != nil {
			return fail(err)
		}
		defer tr.Close()
		trs = append(trs, tr)
	}
	var srcs [2][][]byte
	for p := range srcs {
		mem, blocks := bulkMem(p == 1)
		for i := 0; i+8 <= len(mem); i += 8 {
			binary.LittleEndian.PutUint64(mem[i:], bulkWord(i))
		}
		srcs[p] = blocks
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	fmt.Println(ln.Addr())
	c, err := ln.Accept()
	ln.Close()
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	var msg [ctlLen]byte
	for {
		if _, err := io.ReadFull(c, msg[:]); err != nil {
			return 0 // the parent is done
		}
		switch msg[0] {
		case 't':
			err = trs[msg[1]].Send(context.Background(), transport.Descriptor(msg[4:4+msg[3]]), srcs[msg[2]])
		case 'w':
			for _, b := range srcs[msg[1]] {
				if _, err = c.Write(b); err != nil {
					break
				}
			}
		default:
			err = fmt.Errorf("control message %q", msg[0])
		}
		if err != nil {
			return fail(err)
		}
	}
}

// bulkVariant is one way of moving the bytes in BenchmarkBulkProcess.
type bulkVariant struct {
	name    string
	raw     bool // a plain connection, not tcp
	streams int  // index into bulkStreams
	lowat   bool // the receiver raises SO_RCVLOWAT (as Open does)
	huge    bool // source and destination in huge pages
	took    time.Duration
	ops     int
}

// BenchmarkBulkProcess measures one large transfer between two processes,
// as a generation rank pulls a llama-3.1-8b request of 4096 tokens with
// identical layouts: 512 MiB in blocks of 4 MiB, Sent by another process
// into a receipt over this process's blocks. The ways of moving them are
// taken in turn, one transfer each, round after round, so that a machine
// that swings between runs (this one does, by half) weighs on each alike;
// each reports its own rate, in GB/s (1e9 bytes/s), as a metric:
//   - raw: the floor, the same bytes over one plain connection, 4 MiB per
//     Write, read with io.ReadFull into the same blocks;
//   - s1, s2, s4: tcp with 1, 2 or 4 streams (transport.Options.Streams);
//   - lowat: the receiver raises SO_RCVLOWAT as Open does (rcvLowat);
//     without it, woken by every segment;
//   - 4k or thp: source and destination in 4 KiB pages, as Go's heap
//     gives a pool, or advised to huge pages before first touched.
func BenchmarkBulkProcess(b *testing.B) {
	var vs []*bulkVariant
	for _, huge := range []bool{false, true} {
		pages := map[bool]string{false: "4k", true: "thp"}[huge]
		vs = append(vs, &bulkVariant{name: "raw-" + pages, raw: true, huge: huge})
		for s, n := range bulkStreams {
			for _, lowat := range []bool{false, true} {
				name := fmt.Sprintf("s%d-%s", n, pages)
				if lowat {
					name = fmt.Sprintf("s%d-lowat-%s", n, pages)
				}
				vs = append(vs, &bulkVariant{name: name, streams: s, lowat: lowat, huge: huge})
			}
		}
	}
	cmd, addr, exited := startPeer(b, bulkPeerEnv)
	defer func() { <-exited }()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		cmd.Process.Kill()
		b.Fatal(err)
	}
	defer c.Close()       // the peer exits
	var rxs [2]*Transport // without and with SO_RCVLOWAT
	for i := range rxs {
		if rxs[i], err = Open(context.Background(), transport.Options{}); err != nil {
			b.Fatal(err)
		}
		defer rxs[i].Close()
	}
	rxs[0].rcvLowat = 0 // before any connection comes
	var dsts [2][]byte
	var dstBlocks [2][][]byte
	for p := range dsts {
		dsts[p], dstBlocks[p] = bulkMem(p == 1)
	}
	var msg [ctlLen]byte
	op := func(v *bulkVariant) error {
		p := 0
		if v.huge {
			p = 1
		}
		if v.raw {
			msg[0], msg[1] = 'w', byte(p)
			if _, err := c.Write(msg[:]); err != nil {
				return err
			}
			for _, blk := range dstBlocks[p] {
				if _, err := io.ReadFull(c, blk); err != nil {
					return err
				}
			}
			return nil
		}
		rx := rxs[0]
		if v.lowat {
			rx = rxs[1]
		}
		r, err := rx.Expect(dstBlocks[p])
		if err != nil {
			return err
		}
		d := r.Descriptor()
		msg[0], msg[1], msg[2], msg[3] = 't', byte(v.streams), byte(p), byte(len(d))
		copy(msg[4:], d)
		if _, err := c.Write(msg[:]); err != nil {
			return err
		}
		select {
		case <-r.Done():
			return r.Err()
		case <-exited:
			r.Cancel()
			return errors.New("the peer exited")
		}
	}
	for _, v := range vs { // untimed: dial, fault the pages in, grow the windows
		if err := op(v); err != nil {
			b.Fatalf("%s: %v", v.name, err)
		}
	}
	b.SetBytes(bulkBytes)
	for i := 0; b.Loop(); i++ {
		v := vs[i%len(vs)]
		t0 := time.Now()
		if err := op(v); err != nil {
			b.Fatalf("%s: %v", v.name, err)
		}
		v.took += time.Since(t0)
		v.ops++
	}
	for _, v := range vs {
		if v.ops > 0 {
			b.ReportMetric(float64(v.ops)*bulkBytes/v.took.Seconds()/1e9, v.name+"-GB/s")
		}
	}
	for p, dst := range dsts {
		for i := 0; i+8 <= len(dst); i += 8 << 10 {
			if got, want := binary.LittleEndian.Uint64(dst[i:]), bulkWord(i); got != want {
				b.Fatalf("destination %d, byte %d: word %#x, want %#x", p, i, got, want)
			}
		}
	}
	if n, err := hugepage.Backed(dsts[1]); err == nil {
		b.ReportMetric(float64(n)/float64(len(dsts[1])), "thp-dst-share")
	}
}
