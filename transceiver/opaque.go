package transceiver

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"

	"github.com/kvxfer/kvxfer/layout"
)

// OpaqueState is what the generation instance needs to pull a request from
// the context instance: the context CacheState (for this request, DP rank
// included), the CommState (the control endpoint of every context rank in
// rank order) and the request's transfer token. It rides inside
// disaggregated_params as encoded_opaque_state.
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
}

const (
	opaqueMagic   = "KVXO"
	opaqueVersion = 1
	maxEndpoints  = 4096
	maxEndpoint   = 256
	maxOpaque     = 64 << 10
)

// MarshalBinary encodes s: magic, version, request id, token, CacheState,
// endpoints.
func (s *OpaqueState) MarshalBinary() ([]byte, error) {
	st, err := s.State.MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("transceiver: encode opaque state: %w", err)
	}
	if len(s.Endpoints) == 0 || len(s.Endpoints) > maxEndpoints {
		return nil, fmt.Errorf("transceiver: encode opaque state: %d endpoints, want 1..%d", len(s.Endpoints), maxEndpoints)
	}
	b := append([]byte(opaqueMagic), opaqueVersion)
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
	return b, nil
}

// UnmarshalBinary decodes an opaque state, checking every length before
// using it. Errors wrap ErrBadOpaqueState and name the field and offset.
func (s *OpaqueState) UnmarshalBinary(b []byte) error {
	off := 0
	fail := func(field, why string) error {
		return fmt.Errorf("%w: %s at byte %d: %s", ErrBadOpaqueState, field, off, why)
	}
	if len(b) > maxOpaque {
		return fail("length", fmt.Sprintf("%d bytes, at most %d", len(b), maxOpaque))
	}
	if len(b) < len(opaqueMagic)+1 || string(b[:len(opaqueMagic)]) != opaqueMagic {
		return fail("magic", "not a kvxfer opaque state")
	}
	off = len(opaqueMagic)
	if b[off] != opaqueVersion {
		return fail("version", fmt.Sprintf("version %d, this build reads %d", b[off], opaqueVersion))
	}
	off++
	uv := func(field string, max uint64) (uint64, error) {
		v, n := binary.Uvarint(b[off:])
		if n <= 0 {
			return 0, fail(field, "truncated varint")
		}
		if v > max {
			return 0, fail(field, fmt.Sprintf("%d exceeds %d", v, max))
		}
		off += n
		return v, nil
	}
	var out OpaqueState
	var err error
	if out.RequestID, err = uv("request_id", 1<<64-1); err != nil {
		return err
	}
	if len(b)-off < 16 {
		return fail("token", "truncated")
	}
	copy(out.Token[:], b[off:])
	off += 16
	if out.Tokens, err = uv("tokens", 1<<40); err != nil {
		return err
	}
	n, err := uv("state.len", maxOpaque)
	if err != nil {
		return err
	}
	if int(n) > len(b)-off {
		return fail("state", fmt.Sprintf("length %d, only %d bytes left", n, len(b)-off))
	}
	if err := out.State.UnmarshalBinary(b[off : off+int(n)]); err != nil {
		return fail("state", err.Error())
	}
	off += int(n)
	cnt, err := uv("endpoints", maxEndpoints)
	if err != nil {
		return err
	}
	if cnt == 0 {
		return fail("endpoints", "none")
	}
	if int(cnt) != out.State.Parallel.NumRanks() {
		return fail("endpoints", fmt.Sprintf("%d endpoints for %d context ranks", cnt, out.State.Parallel.NumRanks()))
	}
	out.Endpoints = make([]string, 0, cnt)
	for i := 0; i < int(cnt); i++ {
		l, err := uv(fmt.Sprintf("endpoints[%d].len", i), maxEndpoint)
		if err != nil {
			return err
		}
		if l == 0 || int(l) > len(b)-off {
			return fail(fmt.Sprintf("endpoints[%d]", i), "empty or truncated")
		}
		out.Endpoints = append(out.Endpoints, string(b[off:off+int(l)]))
		off += int(l)
	}
	if off != len(b) {
		return fail("end", fmt.Sprintf("%d trailing bytes", len(b)-off))
	}
	*s = out
	return nil
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
