package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"strconv"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// Wire formats. All integers are big-endian.
//
// Everything on a data connection is a multiple of frameAlign (64) bytes
// long, so that every payload starts at a stream offset that is a multiple
// of 64. The kernel lays a TCP stream out in its buffers at those offsets
// (modulo the page), and copying between user memory and kernel buffers
// whose addresses differ by less than 32 modulo 64 is more than twice as
// slow on common CPUs (a 24-byte header cost 60% of loopback throughput).
//
// Connection preface, written once by the dialling (sending) side, 64 bytes:
//
//	0  4  magic "KVXT"
//	4  1  protocol version (2)
//	5  3  reserved, zero
//	8  8  sender session: random, shared by every connection one sending
//	      Transport has open to this receiver
//	16 48 reserved, zero
//
// The receiver answers a valid preface with one byte, acceptByte, after
// which it never writes on the connection; a sender uses a connection only
// once it has read that byte, so a receiver that refuses it (a client
// certificate it does not trust, which under TLS 1.3 it checks after the
// client's handshake has ended; its connection caps; a version it does not
// speak) fails the sender's dial instead of swallowing a small Send.
// (Version 1 had no accept.)
//
// Frame header, before every frame, 64 bytes:
//
//	0  1  type: 1 DATA, 2 ABORT
//	1  3  reserved, zero
//	4  4  payload length (DATA: 1..MaxFrameBytes; ABORT: 0)
//	8  8  tag of the receipt
//	16 8  offset of the payload in the receipt (ABORT: 0)
//	24 40 reserved, zero
//
// A DATA payload is followed by padLen(length) zero bytes, up to the next
// multiple of 64.
//
// Descriptor (what Expect returns, what Send consumes):
//
//	0  1  descriptor version (1)
//	1  1  n: length of the endpoint, 1..255
//	2  n  receiver endpoint, "host:port"
//	.  8  tag (never 0)
//	.  8  total length in bytes (1..MaxInt64)
const (
	protoVersion  = 2
	acceptByte    = 'A'
	frameAlign    = 64
	prefaceLen    = 64
	headerLen     = 64
	descVersion   = 1
	maxEndpoint   = 255
	frameData     = 1
	frameAbort    = 2
	prefaceMagic  = "KVXT"
	maxFrameBytes = transport.MaxFrameBytes
)

// zeros is the padding after DATA payloads.
var zeros [frameAlign - 1]byte

// padLen returns the number of padding bytes after a payload of n bytes.
func padLen(n int64) int64 { return -n & (frameAlign - 1) }

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// frameHeader is one decoded frame header.
type frameHeader struct {
	typ    byte
	length uint32
	tag    uint64
	offset uint64
}

// putHeader encodes h into b, which must be at least headerLen long.
func putHeader(b []byte, h frameHeader) {
	_ = b[headerLen-1]
	b[0] = h.typ
	b[1], b[2], b[3] = 0, 0, 0
	binary.BigEndian.PutUint32(b[4:8], h.length)
	binary.BigEndian.PutUint64(b[8:16], h.tag)
	binary.BigEndian.PutUint64(b[16:24], h.offset)
	clear(b[24:headerLen])
}

// decodeHeader decodes and checks a frame header on its own: known type,
// zero reserved bytes, a length within bounds. Whether the frame fits its
// receipt is checked by the reader, which knows the receipt.
func decodeHeader(b []byte) (frameHeader, error) {
	if len(b) != headerLen {
		return frameHeader{}, fmt.Errorf("%w: frame header of %d bytes, want %d", transport.ErrProtocol, len(b), headerLen)
	}
	h := frameHeader{
		typ:    b[0],
		length: binary.BigEndian.Uint32(b[4:8]),
		tag:    binary.BigEndian.Uint64(b[8:16]),
		offset: binary.BigEndian.Uint64(b[16:24]),
	}
	if b[1]|b[2]|b[3] != 0 || !allZero(b[24:]) {
		return frameHeader{}, fmt.Errorf("%w: frame header with non-zero reserved bytes", transport.ErrProtocol)
	}
	switch h.typ {
	case frameData:
		if h.length == 0 || h.length > maxFrameBytes {
			return frameHeader{}, fmt.Errorf("%w: data frame of %d bytes (want 1..%d)", transport.ErrProtocol, h.length, maxFrameBytes)
		}
		if h.offset > math.MaxInt64-uint64(h.length) {
			return frameHeader{}, fmt.Errorf("%w: data frame offset %d out of range", transport.ErrProtocol, h.offset)
		}
	case frameAbort:
		if h.length != 0 || h.offset != 0 {
			return frameHeader{}, fmt.Errorf("%w: abort frame with length %d, offset %d (want 0, 0)", transport.ErrProtocol, h.length, h.offset)
		}
	default:
		return frameHeader{}, fmt.Errorf("%w: unknown frame type %d", transport.ErrProtocol, h.typ)
	}
	return h, nil
}

// putPreface encodes the connection preface of a sender session into b.
func putPreface(b []byte, session uint64) {
	_ = b[prefaceLen-1]
	copy(b[0:4], prefaceMagic)
	b[4] = protoVersion
	b[5], b[6], b[7] = 0, 0, 0
	binary.BigEndian.PutUint64(b[8:16], session)
	clear(b[16:prefaceLen])
}

// decodePreface checks a connection preface and returns the sender session.
func decodePreface(b []byte) (uint64, error) {
	if len(b) != prefaceLen || string(b[0:4]) != prefaceMagic {
		return 0, fmt.Errorf("%w: not a kvxfer tcp data connection (bad preface)", transport.ErrProtocol)
	}
	if b[4] != protoVersion {
		return 0, fmt.Errorf("%w: data protocol version %d, want %d", transport.ErrProtocol, b[4], protoVersion)
	}
	if b[5]|b[6]|b[7] != 0 || !allZero(b[16:]) {
		return 0, fmt.Errorf("%w: preface with non-zero reserved bytes", transport.ErrProtocol)
	}
	return binary.BigEndian.Uint64(b[8:16]), nil
}

// descFormat is the layout of this backend's descriptors (see above).
var descFormat = &receipt.Format{
	Backend: "tcp",
	Header:  []byte{descVersion},
	CheckHeader: func(b []byte) error {
		if b[0] != descVersion {
			return fmt.Errorf("version %d, want %d (not a tcp descriptor?)", b[0], descVersion)
		}
		return nil
	},
	CheckEndpoint: checkEndpoint,
}

// checkEndpoint accepts host:port with a non-empty host and a port in
// 1..65535; anything a dialler would have to guess at is refused.
func checkEndpoint(ep string) error {
	if ep == "" {
		return errors.New("empty endpoint")
	}
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return fmt.Errorf("endpoint %q: %v", ep, err)
	}
	if host == "" {
		return fmt.Errorf("endpoint %q without a host", ep)
	}
	for i := 0; i < len(host); i++ {
		if c := host[i]; c <= ' ' || c >= 0x7f {
			return fmt.Errorf("endpoint %q: bad character in host", ep)
		}
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return fmt.Errorf("endpoint %q: bad port", ep)
	}
	return nil
}
