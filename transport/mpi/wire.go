package mpi

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"

	"github.com/kvxfer/kvxfer/transport"
)

// The descriptor of a receipt (what Expect returns and a Send quotes): the
// world it was made in, the receiving rank and transport, the receipt and
// its total, and a checksum of those.
//
//	magic "KXMP" | version u8 | 3 zero bytes | epoch u64 | rank u32 |
//	transport u32 | receipt u64 | total u64 | crc32c of the above u32
const (
	descMagic   = "KXMP"
	descVersion = 1
	descLen     = 4 + 4 + 8 + 4 + 4 + 8 + 8 + 4
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// desc is a decoded descriptor.
type desc struct {
	Epoch     uint64 // the MPI world's epoch (rank 0's, broadcast at Init)
	Rank      int    // the receiving world rank
	Transport uint32 // the receiving Transport, within its process
	Receipt   uint64 // the receipt, unique within its process
	Total     int64  // bytes the receipt expects, > 0
}

func (d desc) encode() transport.Descriptor {
	b := make([]byte, descLen)
	copy(b, descMagic)
	b[4] = descVersion
	binary.LittleEndian.PutUint64(b[8:], d.Epoch)
	binary.LittleEndian.PutUint32(b[16:], uint32(d.Rank))
	binary.LittleEndian.PutUint32(b[20:], d.Transport)
	binary.LittleEndian.PutUint64(b[24:], d.Receipt)
	binary.LittleEndian.PutUint64(b[32:], uint64(d.Total))
	binary.LittleEndian.PutUint32(b[40:], crc32.Checksum(b[:40], castagnoli))
	return b
}

// decodeDesc parses b, refusing (with transport.ErrBadDescriptor) anything
// encode did not produce. It does not check the epoch or the rank against
// a world: the caller does.
func decodeDesc(b []byte) (desc, error) {
	if len(b) != descLen {
		return desc{}, fmt.Errorf("%w: mpi: descriptor of %d bytes, want %d", transport.ErrBadDescriptor, len(b), descLen)
	}
	if string(b[:4]) != descMagic || b[4] != descVersion || b[5]|b[6]|b[7] != 0 {
		return desc{}, fmt.Errorf("%w: mpi: not an MPI descriptor of version %d", transport.ErrBadDescriptor, descVersion)
	}
	if sum := crc32.Checksum(b[:40], castagnoli); sum != binary.LittleEndian.Uint32(b[40:]) {
		return desc{}, fmt.Errorf("%w: mpi: descriptor checksum mismatch", transport.ErrBadDescriptor)
	}
	d := desc{
		Epoch:     binary.LittleEndian.Uint64(b[8:]),
		Rank:      int(binary.LittleEndian.Uint32(b[16:])),
		Transport: binary.LittleEndian.Uint32(b[20:]),
		Receipt:   binary.LittleEndian.Uint64(b[24:]),
		Total:     int64(binary.LittleEndian.Uint64(b[32:])),
	}
	if d.Total <= 0 {
		return desc{}, fmt.Errorf("%w: mpi: descriptor total %d bytes", transport.ErrBadDescriptor, d.Total)
	}
	return d, nil
}

// Control messages travel on the world's control communicator, tag 0,
// each a fixed ctlLen bytes:
//
//	kind u8 | code u8 | 2 zero bytes | transport u32 | receipt u64 |
//	send u64 | a u64 | b u64
//
// Their meaning (S: the sending rank, R: the receiving rank):
//
//	S→R rts:   transport, receipt, send; a = total.            (request to send)
//	R→S cts:   receipt, send; a = data tag, b = frame bytes.    (frames are posted)
//	R→S nack:  receipt, send; code says why (closed, gone, size).
//	R→S stop:  receipt, send; code says why (closed, canceled). (the receipt ended early)
//	S→R count: receipt, send; a = frames S posted (allFrames: every one),
//	           code says why (abort: S stopped; fin: answer to stop).
const ctlLen = 40

type ctlKind uint8

const (
	ctlRTS ctlKind = iota + 1
	ctlCTS
	ctlNack
	ctlStop
	ctlCount
)

func (k ctlKind) String() string {
	switch k {
	case ctlRTS:
		return "rts"
	case ctlCTS:
		return "cts"
	case ctlNack:
		return "nack"
	case ctlStop:
		return "stop"
	case ctlCount:
		return "count"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Codes of nack, stop and count.
const (
	codeNone     uint8 = iota
	codeClosed         // the receiving transport has closed
	codeGone           // the receipt is not armed (cancelled, done, or claimed by another Send)
	codeSize           // the Send's total differs from the receipt's
	codeCanceled       // the receiver cancelled the receipt
	codeAbort          // the sender stopped (ctx, Close)
	codeFin            // the sender's answer to stop
)

// allFrames in a count means every frame of the receipt was posted.
const allFrames = ^uint64(0)

type ctlMsg struct {
	Kind      ctlKind
	Code      uint8
	Transport uint32
	Receipt   uint64
	Send      uint64
	A, B      uint64
}

func (m ctlMsg) put(b []byte) {
	_ = b[ctlLen-1]
	b[0], b[1], b[2], b[3] = byte(m.Kind), m.Code, 0, 0
	binary.LittleEndian.PutUint32(b[4:], m.Transport)
	binary.LittleEndian.PutUint64(b[8:], m.Receipt)
	binary.LittleEndian.PutUint64(b[16:], m.Send)
	binary.LittleEndian.PutUint64(b[24:], m.A)
	binary.LittleEndian.PutUint64(b[32:], m.B)
}

var errCtl = errors.New("mpi: malformed control message")

func parseCtl(b []byte) (ctlMsg, error) {
	if len(b) != ctlLen {
		return ctlMsg{}, fmt.Errorf("%w: %d bytes, want %d", errCtl, len(b), ctlLen)
	}
	m := ctlMsg{
		Kind:      ctlKind(b[0]),
		Code:      b[1],
		Transport: binary.LittleEndian.Uint32(b[4:]),
		Receipt:   binary.LittleEndian.Uint64(b[8:]),
		Send:      binary.LittleEndian.Uint64(b[16:]),
		A:         binary.LittleEndian.Uint64(b[24:]),
		B:         binary.LittleEndian.Uint64(b[32:]),
	}
	if m.Kind < ctlRTS || m.Kind > ctlCount || b[2]|b[3] != 0 || m.Code > codeFin {
		return ctlMsg{}, fmt.Errorf("%w: kind %d code %d", errCtl, b[0], b[1])
	}
	return m, nil
}

// block is one contiguous run of a frame: an offset into a piece.
type block struct {
	Piece int // index in the pieces
	Off   int // offset in that piece
	Len   int // > 0
}

// frameCount is the number of frames of frameBytes that carry total bytes.
func frameCount(total int64, frameBytes int) int {
	return int((total + int64(frameBytes) - 1) / int64(frameBytes))
}

// frameBlocks returns the blocks of pieces that hold bytes [off, off+n) of
// their concatenation, skipping empty pieces. Both sides cut their own
// pieces this way, so frame i is bytes [i*F, min((i+1)*F, total)) on each.
func frameBlocks(pieces [][]byte, off int64, n int) []block {
	var out []block
	var at int64
	for i, p := range pieces {
		if n == 0 {
			break
		}
		end := at + int64(len(p))
		if end <= off || len(p) == 0 {
			at = end
			continue
		}
		start := int(off - at)
		if start < 0 {
			start = 0
		}
		k := min(len(p)-start, n)
		out = append(out, block{Piece: i, Off: start, Len: k})
		n -= k
		off += int64(k)
		at = end
	}
	return out
}

// span is a run of bytes at an address: a block of a frame once its piece
// is resolved to memory.
type span struct {
	Addr uintptr
	Len  int
}

// mergeSpans joins each span to the one before it where it starts at that
// one's end, in place, and returns the runs left: a frame whose blocks lie
// end to end in memory (the consecutive blocks of one pool) becomes one
// contiguous MPI message of bytes instead of an hindexed datatype, which
// costs a datatype's creation and commit at every post. A run never grows
// past maxRun bytes (MPI counts are C ints).
func mergeSpans(spans []span, maxRun int) []span {
	if len(spans) == 0 {
		return spans
	}
	out := spans[:1]
	for _, s := range spans[1:] {
		last := &out[len(out)-1]
		if last.Addr+uintptr(last.Len) == s.Addr && last.Len <= maxRun-s.Len {
			last.Len += s.Len
			continue
		}
		out = append(out, s)
	}
	return out
}
