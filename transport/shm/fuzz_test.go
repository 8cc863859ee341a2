//go:build linux

package shm

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// FuzzDescriptor: the descriptor decoder never panics, and what it accepts
// it encodes back to the same bytes.
func FuzzDescriptor(f *testing.F) {
	good := descFormat.Encode(receipt.Descriptor{Endpoint: endpointPrefix + "0123456789abcdef0123456789abcdef", Tag: 7, Total: 4096})
	f.Add([]byte(good))
	f.Add([]byte(good[:len(good)-1]))
	f.Add([]byte{})
	f.Add([]byte{descKind, descVersion, 44})
	f.Add(bytes.Repeat([]byte{0xff}, 63))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := descFormat.Decode(transport.Descriptor(b))
		if err != nil {
			return
		}
		if !bytes.Equal(descFormat.Encode(d), b) {
			t.Fatalf("decode(%x) = %+v, which encodes to %x", b, d, descFormat.Encode(d))
		}
		if checkEndpoint(d.Endpoint) != nil || d.Tag == 0 || d.Total <= 0 {
			t.Fatalf("decode(%x) accepted %+v", b, d)
		}
	})
}

// FuzzMessage: the message decoder never panics, never reads past what it
// was given, asks for more only when the header is whole and valid or
// missing, and what it accepts it encodes back to the same bytes.
func FuzzMessage(f *testing.F) {
	for _, m := range []*msg{
		{typ: msgHello, version: protoVersion},
		{typ: msgWindow, slotLen: 1 << 20, slots: 8},
		{typ: msgPost, seq: 3},
		{typ: msgIdle, seq: 2},
		{typ: msgRelease, slot: 3},
		{typ: msgCancel, op: 1, seq: 4},
		{typ: msgAbort, tag: 9},
		{typ: msgProbe, op: 1},
		{typ: msgDone, op: 1},
		{typ: msgErr, op: 1, code: codeUnknown, text: "no receipt"},
		{typ: msgErr, code: codeRegion, text: "cannot map"},
		{typ: msgProbeOK, op: 1, nonce: 0xdeadbeef},
	} {
		b := appendMsg(nil, m)
		f.Add(b)
		f.Add(b[:len(b)-1])
		f.Add(append(b, b...))
	}
	f.Add([]byte{msgRead, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, n, err := decodeMsg(b)
		switch {
		case err != nil:
			return
		case n == 0:
			if len(b) >= hdrLen {
				if want, err := msgLen(b[:hdrLen]); err != nil || want <= len(b) {
					t.Fatalf("decode(%x) wants more bytes, with a header for %d (%v)", b, want, err)
				}
			}
			return
		case n > len(b) || n < hdrLen:
			t.Fatalf("decode(%x) consumed %d bytes", b, n)
		}
		if enc := appendMsg(nil, &m); !bytes.Equal(enc, b[:n]) {
			t.Fatalf("decode(%x) = %+v, which encodes to %x", b[:n], m, enc)
		}
	})
}

// FuzzRingEntry: the decoder of ring entries (which a sender writes, and
// can rewrite at any time) never panics, accepts only parts within their
// op, and what it accepts it encodes back to the same bytes.
func FuzzRingEntry(f *testing.F) {
	for _, m := range []*msg{
		{typ: msgRead, op: 1, tag: 2, total: 13, offset: 3, slot: 5, length: 10, last: true},
		{typ: msgRead, op: 1, tag: 2, total: 100, offset: 0, slot: 0, length: 10},
	} {
		b := appendEntry(nil, m)
		f.Add(b)
		f.Add(b[:len(b)-1])
	}
	f.Add(make([]byte, readLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeEntry(b)
		if err != nil {
			return
		}
		if enc := appendEntry(nil, &m); !bytes.Equal(enc, b) {
			t.Fatalf("decode(%x) = %+v, which encodes to %x", b, m, enc)
		}
		if m.op == 0 || m.tag == 0 || m.length == 0 || m.offset+uint64(m.length) > m.total || m.last != (m.offset+uint64(m.length) == m.total) && m.last {
			t.Fatalf("decode(%x) accepted %+v", b, m)
		}
	})
}

// FuzzMsgReader: the stream reader of a connection, fed any bytes in any
// pieces, returns exactly the messages decodeMsg finds one after the other
// in the same bytes, then the error decodeMsg gives or the end of the
// stream (an error wrapping io.EOF between messages, io.ErrUnexpectedEOF
// inside one); it
// never panics and never returns a message it has not read whole.
func FuzzMsgReader(f *testing.F) {
	var all []byte
	for _, m := range []*msg{
		{typ: msgHello, version: protoVersion},
		{typ: msgWindow, slotLen: 1 << 20, slots: 8},
		{typ: msgCancel, op: 1, seq: 4},
		{typ: msgErr, op: 1, code: codeUnknown, text: "no receipt"},
	} {
		all = appendMsg(all, m)
	}
	f.Add(all, uint16(3))
	f.Add(all[:len(all)-2], uint16(9))
	f.Add(bytes.Repeat(appendMsg(nil, &msg{typ: msgErr, op: 2, code: codeBusy, text: string(bytes.Repeat([]byte{'x'}, maxErrText))}), 40), uint16(1000))
	f.Add([]byte{msgPost, 0, 0, 0, 0, 0, 0, 9}, uint16(1))
	f.Fuzz(func(t *testing.T, in []byte, piece uint16) {
		if len(in) > 20<<10 { // past the reader's first buffer (readBufStart), no further
			return
		}
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		var ends [2]*net.UnixConn
		for i, fd := range fds {
			file := os.NewFile(uintptr(fd), "socketpair")
			c, err := net.FileConn(file)
			file.Close()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ends[i] = c.(*net.UnixConn)
		}
		wrote := make(chan error, 1)
		go func() { // in pieces, so that messages are cut anywhere
			step := max(int(piece)%4096+1, len(in)/64) // at most 64 writes: each input runs in well under a millisecond
			var err error
			for at := 0; at < len(in) && err == nil; at += step {
				_, err = ends[0].Write(in[at:min(at+step, len(in))])
			}
			ends[0].CloseWrite()
			wrote <- err
		}()
		ends[1].SetReadDeadline(time.Now().Add(10 * time.Second))
		mr := newMsgReader(ends[1])
		defer mr.closeFds()
		rest := in
		for {
			got, err := mr.next()
			want, n, werr := decodeMsg(rest)
			switch {
			case werr != nil:
				if err == nil || !errors.Is(err, transport.ErrProtocol) {
					t.Fatalf("at byte %d: reader gave %+v, %v; decodeMsg fails: %v", len(in)-len(rest), got, err, werr)
				}
			case n == 0 && len(rest) == 0:
				if !errors.Is(err, io.EOF) {
					t.Fatalf("at the end of the stream: %+v, %v, want io.EOF", got, err)
				}
			case n == 0:
				if !errors.Is(err, io.ErrUnexpectedEOF) {
					t.Fatalf("inside a message cut by the end of the stream (%d bytes): %+v, %v, want io.ErrUnexpectedEOF", len(rest), got, err)
				}
			case err != nil:
				t.Fatalf("at byte %d: %v, want %+v", len(in)-len(rest), err, want)
			case got != want:
				t.Fatalf("at byte %d: %+v, want %+v", len(in)-len(rest), got, want)
			}
			if err != nil {
				break
			}
			rest = rest[n:]
		}
		ends[1].Close() // a writer blocked on a message never read
		<-wrote
	})
}
