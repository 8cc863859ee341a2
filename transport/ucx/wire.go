package ucx

// Wire formats of the ucx backend: endpoints, descriptors and control
// messages. Pure Go, without the build tag, so that the decoders are fuzzed
// in every build.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"regexp"
	"slices"

	"github.com/kvxfer/kvxfer/transport"
)

const (
	// endpointVersion is the first byte of an endpoint: version, the
	// transport's random instance id (8 bytes, little endian), then the UCP
	// worker address. Version 2: the backend's tcp receive buffers are
	// 1 MiB (RX_SEG_SIZE). UCX's tcp sends active messages as long as its
	// own receive buffer, and a peer whose buffer is shorter aborts the
	// process (a UCX assertion), so a version-1 transport (64 KiB) and a
	// version-2 one must refuse each other's endpoints, which they do.
	endpointVersion = 2
	endpointHeader  = 9

	// descVersion is the descriptor format:
	//
	//	"KU" version(1) flags(1)=0 tagBase(8, LE)
	//	uvarint(total) uvarint(n) n*uvarint(group length) uvarint(len(ep)) ep
	//
	// Group i of the receipt travels as one tagged message with tag
	// tagBase|i; the groups cut the receiver's memory, in order.
	descVersion = 1
	descHeader  = 12

	// indexBits low bits of a tag number the groups of one receipt; the
	// other bits are random, from crypto/rand.
	indexBits = 16
	indexMask = 1<<indexBits - 1

	// maxGroups bounds the messages of one receipt (and so the
	// descriptor's size: at most 5 bytes a group).
	maxGroups = 512
	// maxTotal bounds a receipt (a sanity bound on untrusted input).
	maxTotal = 1 << 48

	// Control messages (UCP active messages):
	//
	//	"KC" version(1) type(1) inst(8) a(8) b(8) payload
	ctrlVersion = 1
	ctrlHeader  = 28
)

// Control message types.
const (
	// ctrlHello: first message on a new endpoint. inst is the sender's
	// instance; payload its endpoint, so that the receiver can connect back
	// (for acks and for the goodbye).
	ctrlHello = 1
	// ctrlBye: the sender's transport closes; fail what is in flight to it.
	ctrlBye = 2
	// ctrlAbort: the sender stopped sending to receipt a (tag base); b is
	// the send id to acknowledge, 0 for none.
	ctrlAbort = 3
	// ctrlAck answers an abort: a is the send id, b one of ackCompleted,
	// ackAborted.
	ctrlAck = 4
)

// Answers to an abort.
const (
	// ackCompleted: the receipt had already completed with every byte in
	// place; the send counts as done.
	ackCompleted = 1
	// ackAborted: the receipt fails (or was unknown, cancelled or failed
	// already).
	ackAborted = 2
)

var errShort = errors.New("short")

// encodeEndpoint returns the raw endpoint of a transport.
func encodeEndpoint(inst uint64, addr []byte) []byte {
	b := make([]byte, endpointHeader, endpointHeader+len(addr))
	b[0] = endpointVersion
	binary.LittleEndian.PutUint64(b[1:], inst)
	return append(b, addr...)
}

// parseEndpoint checks a raw endpoint and returns its instance id and
// worker address.
func parseEndpoint(ep []byte) (inst uint64, addr []byte, err error) {
	if len(ep) <= endpointHeader || len(ep) > transport.MaxDescriptorBytes {
		return 0, nil, fmt.Errorf("endpoint of %d bytes", len(ep))
	}
	if ep[0] != endpointVersion {
		return 0, nil, fmt.Errorf("endpoint version %d, want %d", ep[0], endpointVersion)
	}
	return binary.LittleEndian.Uint64(ep[1:]), ep[endpointHeader:], nil
}

// descriptor is a decoded Descriptor.
type descriptor struct {
	tagBase  uint64
	total    int64
	groups   []int64 // lengths, each > 0, summing to total
	endpoint []byte  // raw, see encodeEndpoint
}

func (d *descriptor) encode() []byte {
	b := make([]byte, descHeader, descHeader+3*binary.MaxVarintLen64+len(d.groups)*3+len(d.endpoint))
	b[0], b[1], b[2], b[3] = 'K', 'U', descVersion, 0
	binary.LittleEndian.PutUint64(b[4:], d.tagBase)
	b = binary.AppendUvarint(b, uint64(d.total))
	b = binary.AppendUvarint(b, uint64(len(d.groups)))
	for _, g := range d.groups {
		b = binary.AppendUvarint(b, uint64(g))
	}
	b = binary.AppendUvarint(b, uint64(len(d.endpoint)))
	return append(b, d.endpoint...)
}

// decodeDescriptor parses an untrusted descriptor; every error wraps
// transport.ErrBadDescriptor.
func decodeDescriptor(b []byte) (*descriptor, error) {
	d, err := decodeDescriptor1(b)
	if err != nil {
		return nil, fmt.Errorf("%w: ucx: %v", transport.ErrBadDescriptor, err)
	}
	return d, nil
}

func decodeDescriptor1(b []byte) (*descriptor, error) {
	if len(b) > transport.MaxDescriptorBytes {
		return nil, fmt.Errorf("%d bytes, more than %d", len(b), transport.MaxDescriptorBytes)
	}
	if len(b) < descHeader {
		return nil, fmt.Errorf("%d bytes, too short", len(b))
	}
	if b[0] != 'K' || b[1] != 'U' {
		return nil, errors.New("not a ucx descriptor")
	}
	if b[2] != descVersion || b[3] != 0 {
		return nil, fmt.Errorf("version %d flags %#x, want %d and 0", b[2], b[3], descVersion)
	}
	d := &descriptor{tagBase: binary.LittleEndian.Uint64(b[4:])}
	if d.tagBase&indexMask != 0 {
		return nil, errors.New("tag with index bits set")
	}
	r := b[descHeader:]
	next := func() (uint64, error) {
		v, n := binary.Uvarint(r)
		if n <= 0 {
			return 0, errShort
		}
		r = r[n:]
		return v, nil
	}
	total, err := next()
	if err != nil || total == 0 || total > maxTotal {
		return nil, fmt.Errorf("bad total (%d, %v)", total, err)
	}
	n, err := next()
	if err != nil || n == 0 || n > maxGroups || n > total {
		return nil, fmt.Errorf("bad group count (%d, %v)", n, err)
	}
	d.total = int64(total)
	d.groups = make([]int64, n)
	var sum uint64
	for i := range d.groups {
		g, err := next()
		if err != nil || g == 0 || g > total-sum {
			return nil, fmt.Errorf("bad group %d (%d, %v)", i, g, err)
		}
		sum += g
		d.groups[i] = int64(g)
	}
	if sum != total {
		return nil, fmt.Errorf("groups sum to %d, total %d", sum, total)
	}
	epLen, err := next()
	if err != nil || epLen != uint64(len(r)) {
		return nil, fmt.Errorf("endpoint length %d with %d bytes left (%v)", epLen, len(r), err)
	}
	if _, _, err := parseEndpoint(r); err != nil {
		return nil, err
	}
	d.endpoint = bytes.Clone(r)
	// Only the canonical encoding is accepted (no padded varints).
	if !bytes.Equal(d.encode(), b) {
		return nil, errors.New("not in canonical form")
	}
	return d, nil
}

// ctrlMsg is a control message.
type ctrlMsg struct {
	typ     byte
	inst    uint64 // the sending transport's instance id
	a, b    uint64
	payload []byte
}

func (m *ctrlMsg) encode() []byte {
	b := make([]byte, ctrlHeader, ctrlHeader+len(m.payload))
	b[0], b[1], b[2], b[3] = 'K', 'C', ctrlVersion, m.typ
	binary.LittleEndian.PutUint64(b[4:], m.inst)
	binary.LittleEndian.PutUint64(b[12:], m.a)
	binary.LittleEndian.PutUint64(b[20:], m.b)
	return append(b, m.payload...)
}

// decodeCtrl parses an untrusted control message.
func decodeCtrl(b []byte) (*ctrlMsg, error) {
	if len(b) < ctrlHeader {
		return nil, fmt.Errorf("ucx: control message of %d bytes", len(b))
	}
	if b[0] != 'K' || b[1] != 'C' || b[2] != ctrlVersion {
		return nil, errors.New("ucx: not a control message of this version")
	}
	m := &ctrlMsg{
		typ:  b[3],
		inst: binary.LittleEndian.Uint64(b[4:]),
		a:    binary.LittleEndian.Uint64(b[12:]),
		b:    binary.LittleEndian.Uint64(b[20:]),
	}
	p := b[ctrlHeader:]
	switch m.typ {
	case ctrlHello:
		inst, _, err := parseEndpoint(p)
		if err != nil {
			return nil, fmt.Errorf("ucx: hello: %w", err)
		}
		if inst != m.inst {
			return nil, errors.New("ucx: hello: instance mismatch")
		}
		m.payload = bytes.Clone(p)
	case ctrlBye, ctrlAbort, ctrlAck:
		if len(p) != 0 {
			return nil, fmt.Errorf("ucx: control message type %d with %d bytes of payload", m.typ, len(p))
		}
		if m.typ == ctrlAck && m.b != ackCompleted && m.b != ackAborted {
			return nil, fmt.Errorf("ucx: ack %d", m.b)
		}
	default:
		return nil, fmt.Errorf("ucx: control message type %d", m.typ)
	}
	return m, nil
}

// Grouping of a receipt's memory into messages.
const (
	// bigSegment: a segment at least this long is a message of its own,
	// contiguous, so that UCX moves it by zero-copy rendezvous (cma, RDMA).
	bigSegment = 256 << 10
	// smallGroup: consecutive smaller segments are gathered into one
	// message of about this many bytes (UCP iov datatype).
	smallGroup = 4 << 20
)

// planGroups cuts segments (lengths, zero ones included) into at most
// limit messages and returns, for each, the index range [from, to) of the
// segments it covers. Zero-length segments belong to a neighbouring group
// and are skipped when posting.
func planGroups(sizes []int, limit int) [][2]int {
	var groups [][2]int
	start, acc := -1, 0 // the open small group
	flush := func(end int) {
		if start >= 0 {
			groups = append(groups, [2]int{start, end})
			start, acc = -1, 0
		}
	}
	for i, n := range sizes {
		switch {
		case n == 0:
			continue
		case n >= bigSegment:
			flush(i)
			groups = append(groups, [2]int{i, i + 1})
		default:
			if start < 0 {
				start = i
			}
			acc += n
			if acc >= smallGroup {
				flush(i + 1)
			}
		}
	}
	flush(len(sizes))
	for len(groups) > limit {
		groups = mergePairs(groups)
	}
	return groups
}

// mergePairs halves the number of groups by merging neighbours.
func mergePairs(g [][2]int) [][2]int {
	out := make([][2]int, 0, (len(g)+1)/2)
	for i := 0; i < len(g); i += 2 {
		if i+1 < len(g) {
			out = append(out, [2]int{g[i][0], g[i+1][1]})
		} else {
			out = append(out, g[i])
		}
	}
	return out
}

// splitPieces cuts src, as one stream, into the pieces of each group of
// the given lengths (which sum to src's total); empty pieces are left out.
func splitPieces(src [][]byte, groups []int64) [][][]byte {
	out := make([][][]byte, len(groups))
	var cur []byte
	for gi, g := range groups {
		var pieces [][]byte
		for g > 0 {
			for len(cur) == 0 {
				cur, src = src[0], src[1:]
			}
			k := min(int64(len(cur)), g)
			pieces = append(pieces, cur[:k:k])
			cur, g = cur[k:], g-k
		}
		out[gi] = pieces
	}
	return out
}

// laneRE finds the transport of each lane in ucp_ep_print_info's table:
//
//	#                 lane[0]:  3:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0 keepalive
//	#                 lane[1]:  5:cma/memory.0 md[4]   -> md[4]/cma/sysdev[255] rma_bw#0
var laneRE = regexp.MustCompile(`lane\[\d+\]:\s+\d+:([A-Za-z0-9_]+)/`)

// parseLanes returns the transports of the lanes in ucp_ep_print_info's
// output, each once, in lane order.
func parseLanes(info string) []string {
	var tls []string
	for _, m := range laneRE.FindAllStringSubmatch(info, -1) {
		if !slices.Contains(tls, m[1]) {
			tls = append(tls, m[1])
		}
	}
	return tls
}
