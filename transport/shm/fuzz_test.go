//go:build linux

package shm

import (
	"bytes"
	"testing"

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
