package transceiver

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"math"
	"time"

	"github.com/kvxfer/kvxfer/layout"
)

// OpaqueState is what the generation instance needs to pull a request from
// the context instance: the context CacheState (for this request, DP rank
// included), the CommState (the control endpoint of every context rank in
// rank order) and the request's transfer token. It rides inside
// disaggregated_params as encoded_opaque_state, through the client-facing
// router, so a context instance with a cluster secret signs it (see Sign
// and the package docs on signed opaque states).
type OpaqueState struct {
	RequestID uint64
	Token     [16]byte
	// Tokens is the number of tokens of the context request's KV cache
	// (0: not recorded).
	Tokens uint64
	State  layout.CacheState
	// Endpoints holds the control endpoint (host:port) of every context
	// rank, in rank order.
	Endpoints []string

	// Signed says whether the state has the signed form (version 2):
	// Expiry, Nonce and MAC are then part of it. A version 1 state is
	// unsigned.
	Signed bool
	// Expiry is when the context instance releases the request's blocks
	// whether or not they were pulled (issue time + kv_transfer_timeout_ms),
	// to the millisecond.
	Expiry time.Time
	// Nonce makes each signed state unique: a generation instance accepts
	// a nonce once.
	Nonce [16]byte
	// MAC is HMAC-SHA256, under a key derived from the cluster secret, of
	// every byte of the encoding before it.
	MAC [32]byte

	// covered is the encoding the MAC covers, as decoded (nil when the
	// state was built in memory): the MAC is checked against the bytes
	// received, not against a re-encoding.
	covered []byte
}

const (
	opaqueMagic    = "KVXO"
	opaqueUnsigned = 1 // version byte of the unsigned form
	opaqueSigned   = 2 // version byte of the signed form
	maxEndpoints   = 4096
	maxEndpoint    = 256
	maxOpaque      = 64 << 10
	macSize        = sha256.Size
	// signedTail is what the signed form adds after the endpoints:
	// expiry (unix milliseconds, big endian), nonce, MAC.
	signedTail = 8 + 16 + macSize
)

// MarshalBinary encodes s: magic, version, request id, token, tokens,
// CacheState, endpoints and, in the signed form, expiry, nonce and MAC.
func (s *OpaqueState) MarshalBinary() ([]byte, error) {
	b, err := s.appendBody(nil)
	if err != nil {
		return nil, err
	}
	if s.Signed {
		b = append(b, s.MAC[:]...)
	}
	return b, nil
}

// appendBody encodes everything but the MAC.
func (s *OpaqueState) appendBody(b []byte) ([]byte, error) {
	st, err := s.State.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("transceiver: encode opaque state: %w", err)
	}
	if len(s.Endpoints) == 0 || len(s.Endpoints) > maxEndpoints {
		return nil, fmt.Errorf("transceiver: encode opaque state: %d endpoints, want 1..%d", len(s.Endpoints), maxEndpoints)
	}
	version := byte(opaqueUnsigned)
	if s.Signed {
		version = opaqueSigned
	}
	b = append(append(b, opaqueMagic...), version)
	b = binary.AppendUvarint(b, s.RequestID)
	b = append(b, s.Token[:]...)
	b = binary.AppendUvarint(b, s.Tokens)
	b = binary.AppendUvarint(b, uint64(len(st)))
	b = append(b, st...)
	b = binary.AppendUvarint(b, uint64(len(s.Endpoints)))
	for _, e := range s.Endpoints {
		if len(e) == 0 || len(e) > maxEndpoint {
			return nil, fmt.Errorf("transceiver: encode opaque state: endpoint %q has a bad length", e)
		}
		b = binary.AppendUvarint(b, uint64(len(e)))
		b = append(b, e...)
	}
	if s.Signed {
		b = binary.BigEndian.AppendUint64(b, uint64(s.Expiry.UnixMilli()))
		b = append(b, s.Nonce[:]...)
	}
	return b, nil
}

// UnmarshalBinary decodes an opaque state of either form, checking every
// length before using it. Errors wrap ErrBadOpaqueState and name the field
// and offset. It does not check the MAC: see Transceiver.CheckOpaque.
func (s *OpaqueState) UnmarshalBinary(b []byte) error {
	d := opaqueDecoder{b: b}
	var out OpaqueState
	if err := d.header(&out); err != nil {
		return err
	}
	if err := d.request(&out); err != nil {
		return err
	}
	if err := d.endpoints(&out); err != nil {
		return err
	}
	if out.Signed {
		if err := d.signature(&out); err != nil {
			return err
		}
	}
	if d.off != len(b) {
		return d.fail("end", fmt.Sprintf("%d trailing bytes", len(b)-d.off))
	}
	*s = out
	return nil
}

// opaqueDecoder reads an encoded opaque state, field by field.
type opaqueDecoder struct {
	b   []byte
	off int // where the next field starts
}

// fail reports field, at the current offset, as malformed.
func (d *opaqueDecoder) fail(field, why string) error {
	return fmt.Errorf("%w: %s at byte %d: %s", ErrBadOpaqueState, field, d.off, why)
}

func (d *opaqueDecoder) uvarint(field string, max uint64) (uint64, error) {
	v, n := binary.Uvarint(d.b[d.off:])
	if n <= 0 {
		return 0, d.fail(field, "truncated varint")
	}
	if v > max {
		return 0, d.fail(field, fmt.Sprintf("%d exceeds %d", v, max))
	}
	d.off += n
	return v, nil
}

// header reads the magic and the version (which says whether the state is
// signed).
func (d *opaqueDecoder) header(out *OpaqueState) error {
	if len(d.b) > maxOpaque {
		return d.fail("length", fmt.Sprintf("%d bytes, at most %d", len(d.b), maxOpaque))
	}
	if len(d.b) < len(opaqueMagic)+1 || string(d.b[:len(opaqueMagic)]) != opaqueMagic {
		return d.fail("magic", "not a kvxfer opaque state")
	}
	d.off = len(opaqueMagic)
	switch d.b[d.off] {
	case opaqueUnsigned:
	case opaqueSigned:
		out.Signed = true
	default:
		return d.fail("version", fmt.Sprintf("version %d, this build reads %d (unsigned) and %d (signed)", d.b[d.off], opaqueUnsigned, opaqueSigned))
	}
	d.off++
	return nil
}

// request reads the request id, the token, the token count and the
// CacheState.
func (d *opaqueDecoder) request(out *OpaqueState) error {
	var err error
	if out.RequestID, err = d.uvarint("request_id", 1<<64-1); err != nil {
		return err
	}
	if len(d.b)-d.off < 16 {
		return d.fail("token", "truncated")
	}
	copy(out.Token[:], d.b[d.off:])
	d.off += 16
	if out.Tokens, err = d.uvarint("tokens", 1<<40); err != nil {
		return err
	}
	n, err := d.uvarint("state.len", maxOpaque)
	if err != nil {
		return err
	}
	if int(n) > len(d.b)-d.off {
		return d.fail("state", fmt.Sprintf("length %d, only %d bytes left", n, len(d.b)-d.off))
	}
	if err := out.State.UnmarshalBinary(d.b[d.off : d.off+int(n)]); err != nil {
		return d.fail("state", err.Error())
	}
	d.off += int(n)
	return nil
}

// endpoints reads the control endpoints, one per context rank.
func (d *opaqueDecoder) endpoints(out *OpaqueState) error {
	cnt, err := d.uvarint("endpoints", maxEndpoints)
	if err != nil {
		return err
	}
	if cnt == 0 {
		return d.fail("endpoints", "none")
	}
	if int(cnt) != out.State.Parallel.NumRanks() {
		return d.fail("endpoints", fmt.Sprintf("%d endpoints for %d context ranks", cnt, out.State.Parallel.NumRanks()))
	}
	out.Endpoints = make([]string, 0, cnt)
	for i := 0; i < int(cnt); i++ {
		l, err := d.uvarint(fmt.Sprintf("endpoints[%d].len", i), maxEndpoint)
		if err != nil {
			return err
		}
		if l == 0 || int(l) > len(d.b)-d.off {
			return d.fail(fmt.Sprintf("endpoints[%d]", i), "empty or truncated")
		}
		out.Endpoints = append(out.Endpoints, string(d.b[d.off:d.off+int(l)]))
		d.off += int(l)
	}
	return nil
}

// signature reads the tail of the signed form: expiry, nonce, MAC; it
// keeps the bytes the MAC covers.
func (d *opaqueDecoder) signature(out *OpaqueState) error {
	if len(d.b)-d.off < signedTail {
		return d.fail("signature", fmt.Sprintf("%d bytes left, the signed form ends with %d (expiry, nonce, MAC)", len(d.b)-d.off, signedTail))
	}
	ms := binary.BigEndian.Uint64(d.b[d.off:])
	if ms > math.MaxInt64 {
		return d.fail("expiry", "out of range")
	}
	out.Expiry = time.UnixMilli(int64(ms))
	d.off += 8
	copy(out.Nonce[:], d.b[d.off:])
	d.off += 16
	out.covered = d.b[:d.off:d.off]
	copy(out.MAC[:], d.b[d.off:])
	d.off += macSize
	return nil
}

// macKey derives the key that signs opaque states from the cluster secret,
// so that the secret itself signs nothing and other uses of it (say, router
// authentication) get keys of their own.
func macKey(secret []byte) []byte {
	k, err := hkdf.Key(sha256.New, secret, nil, "kvxfer opaque state v2", sha256.Size)
	if err != nil {
		panic(fmt.Sprintf("transceiver: derive the opaque-state key: %v", err)) // only for absurd lengths
	}
	return k
}

// sign turns s into the signed form, with expiry exp (to the millisecond), a
// fresh random nonce and the MAC under key (see macKey).
func (s *OpaqueState) sign(key []byte, exp time.Time) error {
	var nonce [16]byte
	rand.Read(nonce[:])
	return s.signWith(key, exp, nonce)
}

// signWith is sign with a given nonce (tests and fuzz seeds need fixed
// ones).
func (s *OpaqueState) signWith(key []byte, exp time.Time, nonce [16]byte) error {
	s.Signed, s.Expiry, s.Nonce = true, time.UnixMilli(exp.UnixMilli()), nonce
	body, err := s.appendBody(nil)
	if err != nil {
		return err
	}
	m := hmac.New(sha256.New, key)
	m.Write(body)
	copy(s.MAC[:], m.Sum(nil))
	s.covered = body
	return nil
}

// validMAC reports, in constant time, whether the MAC of a signed s is
// right under key.
func (s *OpaqueState) validMAC(key []byte) bool {
	if !s.Signed {
		return false
	}
	body := s.covered
	if body == nil {
		var err error
		if body, err = s.appendBody(nil); err != nil {
			return false
		}
	}
	m := hmac.New(sha256.New, key)
	m.Write(body)
	return hmac.Equal(m.Sum(nil), s.MAC[:])
}

// EncodeOpaque returns the base64 form used over HTTP (encoded_opaque_state).
func EncodeOpaque(s *OpaqueState) (string, error) {
	b, err := s.MarshalBinary()
	if err != nil {
		return "", err
	}
	return base64.StdEncoding.EncodeToString(b), nil
}

// DecodeOpaque parses the base64 form of an opaque state.
func DecodeOpaque(s string) (*OpaqueState, error) {
	if len(s) > base64.StdEncoding.EncodedLen(maxOpaque) {
		return nil, fmt.Errorf("%w: %d characters of base64, too long", ErrBadOpaqueState, len(s))
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("%w: not base64: %v", ErrBadOpaqueState, err)
	}
	var o OpaqueState
	if err := o.UnmarshalBinary(b); err != nil {
		return nil, err
	}
	return &o, nil
}
