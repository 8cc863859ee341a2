package wire

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/kvxfer/kvxfer/internal/wirefield"
)

// Version is the control protocol version carried in Hello. A peer with
// another version is refused with both versions named. Version 2: a
// generation request's RequestInfo.GenRequestID is the same on all its
// ranks and names its pull attempt (a context rank serving several of its
// ranks would take version 1's per-rank ids for competing pulls).
// Version 3: RequestInfo carries the digest of the generation request's
// prompt, which the context rank compares with its own.
const Version = 3

// Limits of the control protocol.
const (
	// MaxFrame bounds a frame (type byte and payload).
	MaxFrame = 256 << 10
	// MaxReason bounds the text of Refused and Abort.
	MaxReason = 8 << 10
	// MaxBlob bounds an opaque field (an encoded CacheState, a descriptor,
	// a data-plane endpoint).
	MaxBlob = 8 << 10
	// MaxBackends bounds the backend list of Hello.
	MaxBackends = 16
	// MaxName bounds a host or backend name.
	MaxName = 256
)

// Type identifies a frame.
type Type uint8

// Frame types.
const (
	TypeHello Type = iota + 1
	TypeRequestInfo
	TypeReady
	TypeRefused
	TypeChunkDesc
	TypeAbort
	TypePing
	TypePong
)

var typeNames = [...]string{"invalid", "hello", "request-info", "ready", "refused", "chunk-desc", "abort", "ping", "pong"}

func (t Type) String() string {
	if int(t) < len(typeNames) {
		return typeNames[t]
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// ErrMalformed is wrapped by every decoding error.
var ErrMalformed = errors.New("wire: malformed frame")

// Frame is one control frame.
type Frame interface {
	// Type is the frame's type.
	Type() Type
	appendPayload(b []byte) []byte
	decodePayload(d *decoder)
}

// Hello opens a control connection, in both directions.
type Hello struct {
	Version  uint16
	Rank     uint32 // sender's rank in its instance
	State    []byte // sender instance's CacheState (layout encoding)
	Host     string // host identity, for same-host detection
	Backends []string
	// Endpoints[i] is the data-plane endpoint of Backends[i] on the
	// sender's rank (for probing: see transport.Prober).
	Endpoints []string
}

// RequestInfo asks a context rank for its part of a request's KV cache.
type RequestInfo struct {
	CtxRequestID uint64
	Token        [16]byte
	// GenRequestID is the generation side's id for this pull, the same
	// on every generation rank of the request; echoed in replies. The
	// context side tells the pull attempts of one context request apart by
	// it.
	GenRequestID uint64
	GenRank      uint32
	GenState     []byte // the generation instance's CacheState, DP rank included
	// NumBlocks is how many of the request's blocks are wanted: all of them
	// (equal to the context request's count), or the last NumBlocks when the
	// generation side already holds a reused prefix; then LastHash, when
	// HasLastHash, is the hash key of the last block wanted.
	NumBlocks   uint32
	HasLastHash bool
	LastHash    [16]byte
	// PromptDigest is the digest of the generation request's prompt
	// (kvcache.PromptDigest), all zero for none: a context request that
	// has a digest refuses a pull whose digest differs.
	PromptDigest [16]byte
	// MaxChunkBlocks is the most blocks per chunk the receiver can take.
	MaxChunkBlocks uint32
	// Backend is the data-plane backend the receiver chose for this pair.
	Backend string
	// Desc, when not empty, is a receipt for the whole transfer already armed
	// straight into the receiver's blocks (a direct transfer): no chunks follow.
	Desc []byte
}

// Ready tells the generation rank that the context rank will send, in
// chunks of ChunkBlocks blocks.
type Ready struct {
	CtxRequestID uint64
	GenRequestID uint64
	ChunkBlocks  uint32
}

// Refusal codes.
const (
	RefusedUnknown      = 1 // no such request, wrong token, expired or already pulled
	RefusedIncompatible = 2 // the two CacheStates cannot be paired
	RefusedBadRequest   = 3 // the request-info itself is wrong
	RefusedVersion      = 4 // protocol versions differ
	RefusedUnavailable  = 5 // backend not available, shutting down
)

// Refused declines a Hello or a RequestInfo, with the reason.
type Refused struct {
	CtxRequestID uint64
	GenRequestID uint64
	Code         uint8
	Reason       string
}

// ChunkDesc hands the context rank the receipt for chunk Index.
type ChunkDesc struct {
	CtxRequestID uint64
	GenRequestID uint64
	Index        uint32
	Desc         []byte
}

// Abort ends a transfer with an error, in either direction.
type Abort struct {
	CtxRequestID uint64
	GenRequestID uint64
	Reason       string
}

// Ping asks for a Pong with the same nonce.
type Ping struct{ Nonce uint64 }

// Pong answers a Ping.
type Pong struct{ Nonce uint64 }

// Type implementations.
func (*Hello) Type() Type       { return TypeHello }
func (*RequestInfo) Type() Type { return TypeRequestInfo }
func (*Ready) Type() Type       { return TypeReady }
func (*Refused) Type() Type     { return TypeRefused }
func (*ChunkDesc) Type() Type   { return TypeChunkDesc }
func (*Abort) Type() Type       { return TypeAbort }
func (*Ping) Type() Type        { return TypePing }
func (*Pong) Type() Type        { return TypePong }

// Append appends f's encoding (length prefix included) to b.
func Append(b []byte, f Frame) ([]byte, error) {
	start := len(b)
	b = append(b, 0, 0, 0, 0, byte(f.Type()))
	b = f.appendPayload(b)
	n := len(b) - start - 4
	if n > MaxFrame {
		return b[:start], fmt.Errorf("wire: %s frame of %d bytes exceeds %d", f.Type(), n, MaxFrame)
	}
	binary.LittleEndian.PutUint32(b[start:], uint32(n))
	return b, nil
}

// Write writes one frame to w with a single Write call.
func Write(w io.Writer, f Frame) error {
	b, err := Append(make([]byte, 0, 128), f)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// Read reads one frame from r. A length beyond MaxFrame, an unknown type or
// a malformed payload is an error wrapping ErrMalformed; the connection
// should then be closed, since framing can no longer be trusted.
func Read(r *bufio.Reader) (Frame, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n == 0 || n > MaxFrame {
		return nil, fmt.Errorf("%w: length %d not in 1..%d", ErrMalformed, n, MaxFrame)
	}
	buf, err := readBody(r, int(n))
	if err != nil {
		return nil, err
	}
	return Decode(buf)
}

// bodyStart is the most memory readBody gives a frame before its bytes
// arrive (unless more are buffered already).
const bodyStart = 4 << 10

// readBody reads the n bytes of a frame's body. Its memory grows with what
// arrives, doubling, rather than being taken at once from the length: a
// stranger's 4-byte header announcing MaxFrame, before any hello, would
// otherwise hold MaxFrame bytes for the handshake or frame timeout.
func readBody(r *bufio.Reader, n int) ([]byte, error) {
	buf := make([]byte, min(n, max(r.Buffered(), bodyStart)))
	for got := 0; ; {
		k, err := io.ReadFull(r, buf[got:])
		if got += k; err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		if got == n {
			return buf, nil
		}
		buf = slices.Grow(buf, min(n-got, got))[:got+min(n-got, got)]
	}
}

// Decode decodes one frame body (type byte and payload, no length prefix).
func Decode(body []byte) (Frame, error) {
	if len(body) == 0 {
		return nil, fmt.Errorf("%w: empty frame", ErrMalformed)
	}
	var f Frame
	switch Type(body[0]) {
	case TypeHello:
		f = &Hello{}
	case TypeRequestInfo:
		f = &RequestInfo{}
	case TypeReady:
		f = &Ready{}
	case TypeRefused:
		f = &Refused{}
	case TypeChunkDesc:
		f = &ChunkDesc{}
	case TypeAbort:
		f = &Abort{}
	case TypePing:
		f = &Ping{}
	case TypePong:
		f = &Pong{}
	default:
		return nil, fmt.Errorf("%w: unknown frame type %d", ErrMalformed, body[0])
	}
	d := newDecoder(body, f.Type())
	f.decodePayload(d)
	if err := d.End(); err != nil {
		return nil, err
	}
	return f, nil
}

// decoder reads the bounded fields of one frame's payload; its errors
// wrap ErrMalformed and name the frame, the field and the byte.
type decoder struct {
	wirefield.Decoder
	frame Type
}

func newDecoder(body []byte, frame Type) *decoder {
	d := &decoder{frame: frame}
	d.Buf, d.Off = body, 1
	d.Wrap = func(field string, off int, why string) error {
		return fmt.Errorf("%w: %s.%s at byte %d: %s", ErrMalformed, d.frame, field, off, why)
	}
	return d
}

// bytes reads a length-prefixed field into memory of its own (a frame's
// fields outlive the read buffer).
func (d *decoder) bytes(field string, max int) []byte {
	b := d.Bytes(field, max)
	if d.Err != nil {
		return nil
	}
	return append(make([]byte, 0, len(b)), b...)
}

func (d *decoder) string(field string, max int) string { return string(d.Bytes(field, max)) }

func (f *Hello) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, uint64(f.Version))
	b = binary.AppendUvarint(b, uint64(f.Rank))
	b = wirefield.AppendBytes(b, f.State)
	b = wirefield.AppendBytes(b, []byte(f.Host))
	b = binary.AppendUvarint(b, uint64(len(f.Backends)))
	for _, s := range f.Backends {
		b = wirefield.AppendBytes(b, []byte(s))
	}
	b = binary.AppendUvarint(b, uint64(len(f.Endpoints)))
	for _, s := range f.Endpoints {
		b = wirefield.AppendBytes(b, []byte(s))
	}
	return b
}

func (f *Hello) decodePayload(d *decoder) {
	f.Version = uint16(d.Uvarint("version", 1<<16-1))
	f.Rank = uint32(d.Uvarint("rank", 1<<20))
	f.State = d.bytes("state", MaxBlob)
	f.Host = d.string("host", MaxName)
	n := int(d.Uvarint("backends", MaxBackends))
	for i := 0; i < n && d.Err == nil; i++ {
		f.Backends = append(f.Backends, d.string(fmt.Sprintf("backends[%d]", i), MaxName))
	}
	n = int(d.Uvarint("endpoints", MaxBackends))
	for i := 0; i < n && d.Err == nil; i++ {
		f.Endpoints = append(f.Endpoints, d.string(fmt.Sprintf("endpoints[%d]", i), MaxBlob))
	}
}

func (f *RequestInfo) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, f.CtxRequestID)
	b = append(b, f.Token[:]...)
	b = binary.AppendUvarint(b, f.GenRequestID)
	b = binary.AppendUvarint(b, uint64(f.GenRank))
	b = wirefield.AppendBytes(b, f.GenState)
	b = binary.AppendUvarint(b, uint64(f.NumBlocks))
	b = wirefield.AppendBool(b, f.HasLastHash)
	if f.HasLastHash {
		b = append(b, f.LastHash[:]...)
	}
	b = append(b, f.PromptDigest[:]...)
	b = binary.AppendUvarint(b, uint64(f.MaxChunkBlocks))
	b = wirefield.AppendBytes(b, []byte(f.Backend))
	return wirefield.AppendBytes(b, f.Desc)
}

func (f *RequestInfo) decodePayload(d *decoder) {
	f.CtxRequestID = d.Uvarint("ctx_request_id", 1<<64-1)
	d.Fixed("token", f.Token[:])
	f.GenRequestID = d.Uvarint("gen_request_id", 1<<64-1)
	f.GenRank = uint32(d.Uvarint("gen_rank", 1<<20))
	f.GenState = d.bytes("gen_state", MaxBlob)
	f.NumBlocks = uint32(d.Uvarint("num_blocks", 1<<31-1))
	f.HasLastHash = d.Bool("has_last_hash")
	if f.HasLastHash {
		d.Fixed("last_hash", f.LastHash[:])
	}
	d.Fixed("prompt_digest", f.PromptDigest[:])
	f.MaxChunkBlocks = uint32(d.Uvarint("max_chunk_blocks", 1<<31-1))
	f.Backend = d.string("backend", MaxName)
	f.Desc = d.bytes("desc", MaxBlob)
}

func (f *Ready) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, f.CtxRequestID)
	b = binary.AppendUvarint(b, f.GenRequestID)
	return binary.AppendUvarint(b, uint64(f.ChunkBlocks))
}

func (f *Ready) decodePayload(d *decoder) {
	f.CtxRequestID = d.Uvarint("ctx_request_id", 1<<64-1)
	f.GenRequestID = d.Uvarint("gen_request_id", 1<<64-1)
	f.ChunkBlocks = uint32(d.Uvarint("chunk_blocks", 1<<31-1))
}

func (f *Refused) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, f.CtxRequestID)
	b = binary.AppendUvarint(b, f.GenRequestID)
	b = append(b, f.Code)
	return wirefield.AppendBytes(b, []byte(truncate(f.Reason)))
}

func (f *Refused) decodePayload(d *decoder) {
	f.CtxRequestID = d.Uvarint("ctx_request_id", 1<<64-1)
	f.GenRequestID = d.Uvarint("gen_request_id", 1<<64-1)
	var c [1]byte
	d.Fixed("code", c[:])
	f.Code = c[0]
	f.Reason = d.string("reason", MaxReason)
}

func (f *ChunkDesc) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, f.CtxRequestID)
	b = binary.AppendUvarint(b, f.GenRequestID)
	b = binary.AppendUvarint(b, uint64(f.Index))
	return wirefield.AppendBytes(b, f.Desc)
}

func (f *ChunkDesc) decodePayload(d *decoder) {
	f.CtxRequestID = d.Uvarint("ctx_request_id", 1<<64-1)
	f.GenRequestID = d.Uvarint("gen_request_id", 1<<64-1)
	f.Index = uint32(d.Uvarint("index", 1<<31-1))
	f.Desc = d.bytes("desc", MaxBlob)
}

func (f *Abort) appendPayload(b []byte) []byte {
	b = binary.AppendUvarint(b, f.CtxRequestID)
	b = binary.AppendUvarint(b, f.GenRequestID)
	return wirefield.AppendBytes(b, []byte(truncate(f.Reason)))
}

func (f *Abort) decodePayload(d *decoder) {
	f.CtxRequestID = d.Uvarint("ctx_request_id", 1<<64-1)
	f.GenRequestID = d.Uvarint("gen_request_id", 1<<64-1)
	f.Reason = d.string("reason", MaxReason)
}

func (f *Ping) appendPayload(b []byte) []byte { return binary.AppendUvarint(b, f.Nonce) }
func (f *Ping) decodePayload(d *decoder)      { f.Nonce = d.Uvarint("nonce", 1<<64-1) }
func (f *Pong) appendPayload(b []byte) []byte { return binary.AppendUvarint(b, f.Nonce) }
func (f *Pong) decodePayload(d *decoder)      { f.Nonce = d.Uvarint("nonce", 1<<64-1) }

// truncate cuts a reason to MaxReason bytes so that an encoder never
// produces a frame its peer must refuse.
func truncate(s string) string {
	if len(s) > MaxReason {
		return s[:MaxReason-3] + "..."
	}
	return s
}
