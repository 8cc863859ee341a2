package transceiver

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvcache"
)

func sampleOpaque() *OpaqueState {
	return &OpaqueState{RequestID: 42, Token: [16]byte{1, 2, 3, 15: 4},
		State:     state(4, 4, 16, 4, kvcache.BF16, 2, 1, false),
		Endpoints: []string{"127.0.0.1:4000", "127.0.0.1:4001"}}
}

func TestOpaqueRoundTrip(t *testing.T) {
	in := sampleOpaque()
	s, err := EncodeOpaque(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := DecodeOpaque(s)
	if err != nil {
		t.Fatal(err)
	}
	if out.RequestID != in.RequestID || out.Token != in.Token || !out.State.Equal(in.State) || strings.Join(out.Endpoints, ",") != strings.Join(in.Endpoints, ",") {
		t.Fatalf("round trip: %+v != %+v", out, in)
	}
}

func TestOpaqueBad(t *testing.T) {
	good, _ := sampleOpaque().MarshalBinary()
	for _, tc := range []struct {
		name string
		in   string
		want string
	}{
		{"not base64", "%%%", "not base64"},
		{"empty", "", "magic"},
		{"other magic", "WFhYWFgK", "not a kvxfer opaque state"},
		{"truncated", encode(good[:len(good)-3]), "endpoints[1]"},
		{"trailing", encode(append(good[:len(good):len(good)], 0)), "trailing"},
		{"version", encode(append([]byte("KVXO\x09"), good[5:]...)), "version 9"},
		{"huge", strings.Repeat("A", 200000), "too long"},
	} {
		_, err := DecodeOpaque(tc.in)
		if !errors.Is(err, ErrBadOpaqueState) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
}

func encode(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// FuzzDecodeOpaque: no panic, bounded, and what decodes re-encodes to the
// same bytes.
func FuzzDecodeOpaque(f *testing.F) {
	good, _ := sampleOpaque().MarshalBinary()
	f.Add(good)
	f.Add([]byte("KVXO\x01"))
	signed := sampleOpaque()
	if err := signed.signWith(macKey(testSecret), time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC), [16]byte{1}); err != nil {
		f.Fatal(err)
	}
	f.Add(mustMarshal(f, signed))
	f.Fuzz(func(t *testing.T, b []byte) {
		var o OpaqueState
		if err := o.UnmarshalBinary(b); err != nil {
			return
		}
		again, err := o.MarshalBinary()
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		var o2 OpaqueState
		if err := o2.UnmarshalBinary(again); err != nil || !bytes.Equal(again, mustMarshal(t, &o2)) {
			t.Fatalf("re-encoding is not stable: %v", err)
		}
	})
}

func mustMarshal(t testing.TB, o *OpaqueState) []byte {
	b, err := o.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// BenchmarkOpaqueSign is the context side's cost per request: sign and
// encode a state of two endpoints.
func BenchmarkOpaqueSign(b *testing.B) {
	key := macKey(testSecret)
	op := sampleOpaque()
	exp := time.Now().Add(time.Minute)
	for b.Loop() {
		if err := op.sign(key, exp); err != nil {
			b.Fatal(err)
		}
		if _, err := op.MarshalBinary(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkOpaqueCheck is the generation side's cost per request before it
// dials: decode, MAC, expiry, allow-list and replay lookup.
func BenchmarkOpaqueCheck(b *testing.B) {
	peers, _ := newPeerPolicy(context.Background(), nil, true, nil, slog.New(slog.DiscardHandler))
	g := newOpaqueGuard(testSecret, peers, time.Now, 0)
	op := sampleOpaque()
	if err := op.sign(g.key, time.Now().Add(time.Hour)); err != nil {
		b.Fatal(err)
	}
	enc, _ := op.MarshalBinary()
	b.SetBytes(int64(len(enc)))
	for b.Loop() {
		var o OpaqueState
		if err := o.UnmarshalBinary(enc); err != nil {
			b.Fatal(err)
		}
		if err := g.check(&o, false); err != nil {
			b.Fatal(err)
		}
	}
}
