package wirefield

import (
	"encoding/binary"
	"fmt"
)

// Decoder reads fields from Buf at Off. Its zero value is not usable:
// Wrap must be set.
type Decoder struct {
	Buf []byte
	Off int
	// Err is the first failure (nil: none).
	Err error
	// Wrap builds the error of the first failure: field failed at byte
	// off, for the reason why.
	Wrap func(field string, off int, why string) error
}

// Fail records a failure of field at the current byte unless one is
// recorded already.
func (d *Decoder) Fail(field, why string) {
	if d.Err == nil {
		d.Err = d.Wrap(field, d.Off, why)
	}
}

// Uvarint reads an unsigned varint of at most max.
func (d *Decoder) Uvarint(field string, max uint64) uint64 {
	if d.Err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.Buf[d.Off:])
	if n <= 0 {
		d.Fail(field, "truncated or overlong varint")
		return 0
	}
	if v > max {
		d.Fail(field, fmt.Sprintf("value %d exceeds %d", v, max))
		return 0
	}
	d.Off += n
	return v
}

// Varint reads a signed varint.
func (d *Decoder) Varint(field string) int64 {
	if d.Err != nil {
		return 0
	}
	v, n := binary.Varint(d.Buf[d.Off:])
	if n <= 0 {
		d.Fail(field, "truncated or overlong varint")
		return 0
	}
	d.Off += n
	return v
}

// Byte reads one byte.
func (d *Decoder) Byte(field string) byte {
	if d.Err != nil {
		return 0
	}
	if d.Off >= len(d.Buf) {
		d.Fail(field, "truncated")
		return 0
	}
	d.Off++
	return d.Buf[d.Off-1]
}

// Bool reads a boolean written by AppendBool (a varint 0 or 1).
func (d *Decoder) Bool(field string) bool {
	return d.Uvarint(field, 1) == 1
}

// Fixed fills dst from the next len(dst) bytes.
func (d *Decoder) Fixed(field string, dst []byte) {
	if d.Err != nil {
		return
	}
	if len(d.Buf)-d.Off < len(dst) {
		d.Fail(field, fmt.Sprintf("need %d bytes, have %d", len(dst), len(d.Buf)-d.Off))
		return
	}
	copy(dst, d.Buf[d.Off:])
	d.Off += len(dst)
}

// Bytes reads bytes written by AppendBytes, at most max of them (a longer
// length fails as field+".len"). The result aliases Buf (its capacity
// ends with it): a caller that keeps it past Buf's life copies it.
func (d *Decoder) Bytes(field string, max int) []byte {
	n := int(d.Uvarint(field+".len", uint64(max)))
	if d.Err != nil {
		return nil
	}
	if len(d.Buf)-d.Off < n {
		d.Fail(field, fmt.Sprintf("length %d, only %d bytes left", n, len(d.Buf)-d.Off))
		return nil
	}
	out := d.Buf[d.Off : d.Off+n : d.Off+n]
	d.Off += n
	return out
}

// End fails as field "end" when bytes are left after the last field, and
// returns the first failure.
func (d *Decoder) End() error {
	if d.Err == nil && d.Off != len(d.Buf) {
		d.Fail("end", fmt.Sprintf("%d trailing bytes", len(d.Buf)-d.Off))
	}
	return d.Err
}

// AppendBytes appends v behind its varint length.
func AppendBytes(b, v []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

// AppendBool appends v as a varint 0 or 1.
func AppendBool(b []byte, v bool) []byte {
	if v {
		return append(b, 1)
	}
	return append(b, 0)
}
