package receipt

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvxfer/kvxfer/transport"
)

// Descriptor is a decoded descriptor of a receipt: where its receiver
// listens, its tag and its length.
type Descriptor struct {
	Endpoint string
	Tag      uint64 // never 0
	Total    int64  // 1..MaxInt64
}

// Format is a backend's descriptor layout, all integers big-endian:
//
//	0  h  Header: the backend's kind and version
//	h  1  n: length of the endpoint
//	.  n  the receiver's endpoint
//	.  8  tag (never 0)
//	.  8  total length in bytes (1..MaxInt64)
type Format struct {
	// Backend names the backend in errors ("tcp").
	Backend string
	// Header leads every descriptor.
	Header []byte
	// CheckHeader reports what is wrong with the header of b (a
	// descriptor of another backend or version, or too short for a
	// header), or nil. b is not empty.
	CheckHeader func(b []byte) error
	// CheckEndpoint reports what is wrong with a decoded endpoint, or nil.
	// Anything a sender would have to guess at must be refused.
	CheckEndpoint func(ep string) error
}

// fixedLen is the length of a descriptor besides its header and endpoint.
const fixedLen = 1 + 8 + 8

// Encode returns d in f's layout. d must be valid: its endpoint at most 255
// bytes long.
func (f *Format) Encode(d Descriptor) transport.Descriptor {
	b := make([]byte, 0, len(f.Header)+fixedLen+len(d.Endpoint))
	b = append(b, f.Header...)
	b = append(b, byte(len(d.Endpoint)))
	b = append(b, d.Endpoint...)
	b = binary.BigEndian.AppendUint64(b, d.Tag)
	b = binary.BigEndian.AppendUint64(b, uint64(d.Total))
	return b
}

// Bad returns an error that wraps transport.ErrBadDescriptor, saying what is
// wrong with a descriptor.
func (f *Format) Bad(format string, args ...any) error {
	return fmt.Errorf("%s: %w: %s", f.Backend, transport.ErrBadDescriptor, fmt.Sprintf(format, args...))
}

// Decode decodes a descriptor from the wire, which is untrusted: every field
// is checked, and the length must match exactly. Its errors wrap
// transport.ErrBadDescriptor.
func (f *Format) Decode(b transport.Descriptor) (Descriptor, error) {
	switch {
	case len(b) == 0:
		return Descriptor{}, f.Bad("empty")
	case len(b) > transport.MaxDescriptorBytes:
		return Descriptor{}, f.Bad("%d bytes, more than %d", len(b), transport.MaxDescriptorBytes)
	}
	if err := f.CheckHeader(b); err != nil {
		return Descriptor{}, f.Bad("%v", err)
	}
	h := len(f.Header)
	if len(b) < h+fixedLen {
		return Descriptor{}, f.Bad("truncated: %d bytes", len(b))
	}
	n := int(b[h])
	if len(b) != h+fixedLen+n {
		return Descriptor{}, f.Bad("%d bytes, want %d for an endpoint of %d bytes", len(b), h+fixedLen+n, n)
	}
	b = b[h+1:]
	d := Descriptor{
		Endpoint: string(b[:n]),
		Tag:      binary.BigEndian.Uint64(b[n:]),
	}
	total := binary.BigEndian.Uint64(b[n+8:])
	if err := f.CheckEndpoint(d.Endpoint); err != nil {
		return Descriptor{}, f.Bad("%v", err)
	}
	if d.Tag == 0 {
		return Descriptor{}, f.Bad("zero tag")
	}
	if total == 0 || total > math.MaxInt64 {
		return Descriptor{}, f.Bad("total length %d out of range", total)
	}
	d.Total = int64(total)
	return d, nil
}
