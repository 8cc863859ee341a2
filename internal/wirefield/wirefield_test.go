package wirefield

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
)

var errBad = errors.New("bad message")

func newDec(b []byte) *Decoder {
	return &Decoder{Buf: b, Wrap: func(field string, off int, why string) error {
		return fmt.Errorf("%w: %s at byte %d: %s", errBad, field, off, why)
	}}
}

// TestRoundTrip: what the appenders and binary's write, the Decoder reads
// back, field by field, and End finds nothing left.
func TestRoundTrip(t *testing.T) {
	var b []byte
	b = binary.AppendUvarint(b, 300)
	b = binary.AppendVarint(b, -5)
	b = append(b, 7)
	b = AppendBool(b, true)
	b = AppendBool(b, false)
	b = append(b, 1, 2, 3)
	b = AppendBytes(b, []byte("endpoint"))
	b = AppendBytes(b, nil)
	d := newDec(b)
	var fixed [3]byte
	u, v, by, t1, f1 := d.Uvarint("u", 1000), d.Varint("v"), d.Byte("b"), d.Bool("t"), d.Bool("f")
	d.Fixed("fixed", fixed[:])
	s, e := d.Bytes("s", 16), d.Bytes("e", 16)
	if err := d.End(); err != nil {
		t.Fatal(err)
	}
	if u != 300 || v != -5 || by != 7 || !t1 || f1 || fixed != [3]byte{1, 2, 3} || string(s) != "endpoint" || len(e) != 0 {
		t.Fatalf("read back %d %d %d %v %v %v %q %q", u, v, by, t1, f1, fixed, s, e)
	}
	if cap(s) != len(s) {
		t.Errorf("Bytes' result has capacity %d past its length %d: an append would write into the buffer", cap(s), len(s))
	}
}

// TestFailures: each kind of bad field fails with its name, its byte and
// why, and the first failure is the one kept.
func TestFailures(t *testing.T) {
	for _, tc := range []struct {
		name string
		buf  []byte
		read func(d *Decoder)
		want string
	}{
		{"varint over max", binary.AppendUvarint(nil, 17), func(d *Decoder) { d.Uvarint("count", 16) }, "count at byte 0: value 17 exceeds 16"},
		{"truncated varint", []byte{0x80}, func(d *Decoder) { d.Uvarint("n", 1<<20) }, "n at byte 0: truncated or overlong varint"},
		{"overlong varint", bytes.Repeat([]byte{0xff}, 11), func(d *Decoder) { d.Uvarint("n", 1<<63) }, "truncated or overlong varint"},
		{"truncated signed", []byte{0x80}, func(d *Decoder) { d.Varint("t") }, "t at byte 0: truncated or overlong varint"},
		{"no byte", nil, func(d *Decoder) { d.Byte("kind") }, "kind at byte 0: truncated"},
		{"bool 2", []byte{2}, func(d *Decoder) { d.Bool("flag") }, "flag at byte 0: value 2 exceeds 1"},
		{"fixed short", []byte{1, 2}, func(d *Decoder) { var x [4]byte; d.Fixed("token", x[:]) }, "token at byte 0: need 4 bytes, have 2"},
		{"length over max", AppendBytes(nil, make([]byte, 9)), func(d *Decoder) { d.Bytes("host", 8) }, "host.len at byte 0: value 9 exceeds 8"},
		{"length past end", []byte{5, 1}, func(d *Decoder) { d.Bytes("desc", 64) }, "desc at byte 1: length 5, only 1 bytes left"},
		{"trailing", []byte{1, 2}, func(d *Decoder) { d.Byte("a") }, "end at byte 1: 1 trailing bytes"},
		{"first kept", []byte{0x80}, func(d *Decoder) { d.Uvarint("first", 1); d.Byte("second"); d.Fail("third", "x") }, "first at byte 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDec(tc.buf)
			tc.read(d)
			err := d.End()
			if !errors.Is(err, errBad) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
}

// FuzzDecoder: any input read as a fixed sequence of fields either fails
// with an error the Wrap built, or reads no further than the buffer; a
// length never allocates past it.
func FuzzDecoder(f *testing.F) {
	f.Add(AppendBytes(binary.AppendUvarint(nil, 3), []byte("abc")))
	f.Add([]byte{0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		d := newDec(b)
		n := d.Uvarint("n", 1<<10)
		for i := uint64(0); i < n && d.Err == nil; i++ {
			if got := d.Bytes("item", 1<<20); d.Err == nil && len(got) > len(b) {
				t.Fatalf("item of %d bytes from %d", len(got), len(b))
			}
		}
		d.Varint("t")
		if err := d.End(); err != nil && !errors.Is(err, errBad) {
			t.Fatalf("error %v not built by Wrap", err)
		}
		if d.Off > len(b) {
			t.Fatalf("read to byte %d of %d", d.Off, len(b))
		}
	})
}
