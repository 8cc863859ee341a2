//go:build linux

package shm

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/internal/receipt"
)

// Wire formats. All integers are big-endian.
//
// Every message on a connection is an 8-byte header and a body:
//
//	0  1  type
//	1  3  reserved, zero
//	4  4  body length (exact per type, or bounded for ERR)
//
// Sender → receiver (on a connection the sender dialled):
//
//	HELLO   8   magic "KVXS", protocol version (4), 3 reserved (zero); first
//	            message of each side (the receiver answers with its own)
//	WINDOW  8   slot size in bytes (4, a multiple of 8), number of slots (4); sent once, with
//	            exactly one descriptor (SCM_RIGHTS): the sender's window, a
//	            memfd of slots × slot size bytes and then the ring (below),
//	            sealed against shrinking, growing and writes
//	            (F_SEAL_FUTURE_WRITE)
//	POST    8   the count of parts posted in the ring so far: wakes a
//	            receiver that said IDLE (a sender writes it only then, at
//	            most once per IDLE; a receiver takes any number, and ignores
//	            the count)
//	CANCEL  16  op id (8), the count of parts posted in the ring when it
//	            was written (8): stop the op once the parts before it are
//	            taken (the receiver answers DONE or ERR); it also ends an op
//	            whose last part was never posted
//	ABORT   8   tag: fail that receipt with ErrAborted if no op is filling
//	            it (a Send that ended before it posted a part)
//	PROBE   8   op id: read the first 8 bytes of the window
//
// Receiver → sender:
//
//	HELLO   8   as above
//	RELEASE 8   slot (4), reserved (4): the part in the slot was handled;
//	            the sender may reuse the slot (several may come in one
//	            write)
//	IDLE    8   the count of parts the receiver has taken from the ring:
//	            it found no more and sleeps until a POST
//	DONE    8   op id: every byte copied, the receipt completed
//	ERR     16+k  op id (8), code (4), k (4, 0..maxErrText), k bytes of
//	            reason text; op id 0 answers the WINDOW: the receiver
//	            cannot map it (code 4), and no part will be taken
//	PROBEOK 16  op id (8), the first 8 bytes of the window
//
// The ring: ringLen(slots) bytes after the slots of the window, which only
// the sender writes. Bytes 0..8 hold the count of parts posted so far, in
// the host's byte order (both ends share the host), written atomically
// after the part's entry; bytes 8..64 are reserved. The entry of the n-th
// part (from 0) is at 64 + (n mod slots) × 48:
//
//	op id (8), tag (8), total length of the op (8), offset of this part in
//	the receipt (8), slot (4), length (4, 1..slot size), flags (4; bit 0:
//	last part), gave up (4): the part's bytes are at the start of the slot
//
// Gave up is 0 when the part is posted. A sender that gives up on an op
// whose last part it posted (its ctx ended while it waited for the
// answer, or it closes the connection under the op) stores 1 there,
// atomically, before it writes the CANCEL (or closes), unless the receiver has released that part already (it then
// answered the op, and the entry may hold another op's part). The
// receiver reads it, atomically, as it handles the last part: once
// before copying and again just before completing the receipt, and fails
// the receipt (ERR, aborted) if it is set. So a receiver that takes the
// part only after the sender gave up (a receiver stalled past the
// CANCEL's grace, which then reads the POST before the CANCEL) does not
// complete a receipt whose Send returned an error. A receiver of
// protocol 4 before this field that reads a set one (it reads the entry
// once, as it takes the part) takes it for a protocol error and closes
// the connection, failing that receipt and the others on it.
//
// A sender posts a part only into a slot released to it, so at most slots
// parts are posted and not taken: a count further ahead, or going back,
// breaks the protocol. The receiver copies an entry out of the ring before
// it checks it.
//
// Descriptor (what Expect returns, what Send consumes), 63 bytes:
//
//	0  1  kind 's' (0x73): not a descriptor of another backend
//	1  1  descriptor version (1)
//	2  1  n: length of the endpoint (44)
//	3  n  receiver endpoint, "@kvxfer-shm-" and 32 lower-case hex digits
//	.  8  tag (never 0)
//	.  8  total length in bytes (1..MaxInt64)
const (
	// protoVersion 4: the receipt completes at DONE, and the ACK of
	// protocol 3 (type 6) is gone.
	protoVersion = 4
	helloMagic   = "KVXS"
	hdrLen       = 8
	readLen      = 48 // a ring entry
	gaveUpAt     = 44 // the gave-up word of a ring entry
	ringHdr      = 64 // the ring's header: the count of parts posted
	maxErrText   = 512
	maxBody      = 16 + maxErrText
	// maxSlotBytes and maxSlots bound a window a receiver maps.
	maxSlotBytes = 64 << 20
	maxSlots     = 1024
	maxWindow    = 256 << 20

	descKind       = 's'
	descVersion    = 1
	endpointPrefix = "@kvxfer-shm-"
	endpointLen    = len(endpointPrefix) + 32
)

// Message types.
const (
	msgHello   = 1
	msgWindow  = 2
	msgPost    = 3
	msgCancel  = 4
	msgAbort   = 5
	_          = 6 // ACK of protocol 3; unknown now
	msgProbe   = 7
	msgDone    = 8
	msgErr     = 9
	msgProbeOK = 10
	msgRelease = 11
	msgIdle    = 12
	// msgRead is the type a decoded ring entry gets; never a message.
	msgRead = 0x80
)

// Flags of a ring entry (READ: the type a decoded entry gets).
const flagLast = 1

// ERR codes: why a receiver refused or stopped an op.
const (
	codeUnknown  = 1 // no armed receipt under the tag (never armed, or ended)
	codeBusy     = 2 // another Send is filling the receipt
	codeMismatch = 3 // the op's length is not the receipt's
	codeRegion   = 4 // the receiver could not map the sender's window
	codeCanceled = 5 // the receiver cancelled the receipt
	codeClosing  = 6 // the receiver's transport is closing
	codeAborted  = 7 // stopped at the sender's CANCEL
)

// msg is one decoded message; which fields mean something depends on typ.
type msg struct {
	typ     byte
	version byte   // HELLO
	op      uint64 // READ CANCEL PROBE DONE ERR PROBEOK
	seq     uint64 // CANCEL POST IDLE: a count of parts in the ring
	tag     uint64 // READ ABORT
	total   uint64 // READ: of the whole op
	offset  uint64 // READ: of the part in the receipt
	slot    uint32 // READ RELEASE
	length  uint32 // READ
	last    bool   // READ
	gaveUp  bool   // READ: the entry's gave-up word (as read; it can change)
	slotLen uint32 // WINDOW
	slots   uint32 // WINDOW
	code    uint32 // ERR
	text    string // ERR
	nonce   uint64 // PROBEOK
}

// errProto returns an ErrProtocol error saying what is wrong.
func errProto(format string, args ...any) error {
	return fmt.Errorf("%w: %s", transport.ErrProtocol, fmt.Sprintf(format, args...))
}

// bodyBounds returns the smallest and largest body length of a message type;
// ok is false for an unknown type.
func bodyBounds(typ byte) (lo, hi int, ok bool) {
	switch typ {
	case msgHello, msgWindow, msgAbort, msgProbe, msgDone, msgRelease, msgPost, msgIdle:
		return 8, 8, true
	case msgProbeOK, msgCancel:
		return 16, 16, true
	case msgErr:
		return 16, 16 + maxErrText, true
	}
	return 0, 0, false
}

// msgLen checks a message header and returns the length of the whole
// message, header included.
func msgLen(h []byte) (int, error) {
	typ := h[0]
	if h[1]|h[2]|h[3] != 0 {
		return 0, errProto("message header with non-zero reserved bytes")
	}
	lo, hi, ok := bodyBounds(typ)
	if !ok {
		return 0, errProto("unknown message type %d", typ)
	}
	n := binary.BigEndian.Uint32(h[4:8])
	if n < uint32(lo) || n > uint32(hi) {
		return 0, errProto("message type %d with a body of %d bytes (want %d..%d)", typ, n, lo, hi)
	}
	return hdrLen + int(n), nil
}

// decodeMsg decodes the message at the start of b. It returns n == 0 and
// no error when b does not hold a whole message yet.
func decodeMsg(b []byte) (m msg, n int, err error) {
	if len(b) < hdrLen {
		return msg{}, 0, nil
	}
	n, err = msgLen(b[:hdrLen])
	if err != nil {
		return msg{}, 0, err
	}
	if len(b) < n {
		return msg{}, 0, nil
	}
	m.typ = b[0]
	if err := m.decodeBody(b[hdrLen:n]); err != nil {
		return msg{}, 0, err
	}
	return m, n, nil
}

// decodeBody decodes and checks the body of a message of type m.typ, whose
// length msgLen has checked.
func (m *msg) decodeBody(body []byte) error {
	be := binary.BigEndian
	switch m.typ {
	case msgHello:
		if string(body[:4]) != helloMagic {
			return errProto("not a kvxfer shm connection (bad hello)")
		}
		if body[5]|body[6]|body[7] != 0 {
			return errProto("hello with non-zero reserved bytes")
		}
		m.version = body[4]
	case msgWindow:
		return m.decodeWindow(body)
	case msgDone, msgProbe:
		if m.op = be.Uint64(body); m.op == 0 {
			return errProto("message type %d for op 0", m.typ)
		}
	case msgCancel:
		if m.op, m.seq = be.Uint64(body), be.Uint64(body[8:]); m.op == 0 {
			return errProto("cancel of op 0")
		}
	case msgPost, msgIdle:
		m.seq = be.Uint64(body)
	case msgAbort:
		if m.tag = be.Uint64(body); m.tag == 0 {
			return errProto("abort of tag 0")
		}
	case msgRelease:
		m.slot = be.Uint32(body)
		if be.Uint32(body[4:]) != 0 {
			return errProto("release with non-zero reserved bytes")
		}
	case msgErr:
		m.op, m.code = be.Uint64(body), be.Uint32(body[8:])
		if k := be.Uint32(body[12:]); (m.op == 0 && m.code != codeRegion) || uint64(k) != uint64(len(body)-16) {
			return errProto("malformed error reply")
		}
		m.text = string(body[16:])
	case msgProbeOK:
		m.op, m.nonce = be.Uint64(body), be.Uint64(body[8:])
		if m.op == 0 {
			return errProto("probe reply for op 0")
		}
	}
	return nil
}

// decodeWindow decodes and checks a WINDOW body: a geometry within bounds.
func (m *msg) decodeWindow(body []byte) error {
	m.slotLen, m.slots = binary.BigEndian.Uint32(body), binary.BigEndian.Uint32(body[4:])
	switch {
	case m.slotLen == 0 || m.slotLen > maxSlotBytes || m.slotLen%8 != 0:
		// A multiple of 8, so that the ring after the slots, whose count
		// and gave-up words are read atomically, is aligned.
		return errProto("window slots of %d bytes (want a multiple of 8 in 8..%d)", m.slotLen, maxSlotBytes)
	case m.slots == 0 || m.slots > maxSlots:
		return errProto("window of %d slots (want 1..%d)", m.slots, maxSlots)
	case uint64(m.slotLen)*uint64(m.slots) > maxWindow:
		return errProto("window of %d x %d bytes, more than %d", m.slots, m.slotLen, maxWindow)
	}
	return nil
}

// decodeEntry decodes and checks a ring entry on its own: non-zero ids,
// known flags, a part within its op, the last part ending it. Whether it
// fits the window and its op's sequence is checked by the receiver.
func decodeEntry(body []byte) (msg, error) {
	if len(body) != readLen {
		return msg{}, errProto("ring entry of %d bytes, want %d", len(body), readLen)
	}
	m := msg{typ: msgRead}
	if err := m.decodeRead(body); err != nil {
		return msg{}, err
	}
	return m, nil
}

// appendEntry appends the ring entry of the part m (a READ) to b: the
// inverse of decodeEntry.
func appendEntry(b []byte, m *msg) []byte {
	be := binary.BigEndian
	b = be.AppendUint64(b, m.op)
	b = be.AppendUint64(b, m.tag)
	b = be.AppendUint64(b, m.total)
	b = be.AppendUint64(b, m.offset)
	b = be.AppendUint32(b, m.slot)
	b = be.AppendUint32(b, m.length)
	var flags uint32
	if m.last {
		flags = flagLast
	}
	b = be.AppendUint32(b, flags)
	var gaveUp uint32
	if m.gaveUp {
		gaveUp = 1
	}
	return be.AppendUint32(b, gaveUp)
}

// ringLen is the length of the ring of a window of slots slots: its header
// and an entry per slot, rounded up to whole pages.
func ringLen(slots int) int { return (ringHdr + slots*readLen + 4095) &^ 4095 }

// decodeRead decodes a READ body (a ring entry) into m.
func (m *msg) decodeRead(body []byte) error {
	u64 := func(i int) uint64 { return binary.BigEndian.Uint64(body[i:]) }
	u32 := func(i int) uint32 { return binary.BigEndian.Uint32(body[i:]) }
	m.op, m.tag, m.total, m.offset = u64(0), u64(8), u64(16), u64(24)
	m.slot, m.length = u32(32), u32(36)
	flags, gaveUp := u32(40), u32(44)
	switch {
	case m.op == 0 || m.tag == 0:
		return errProto("read with op %d, tag %d (want non-zero)", m.op, m.tag)
	case flags&^flagLast != 0:
		return errProto("read with unknown flags %#x", flags)
	case gaveUp > 1:
		return errProto("read with gave-up word %d (want 0 or 1)", gaveUp)
	case m.length == 0:
		return errProto("read part of length 0")
	case m.total == 0 || m.total > math.MaxInt64 || m.offset >= m.total || uint64(m.length) > m.total-m.offset:
		return errProto("read part [%d, +%d) of an op of %d bytes", m.offset, m.length, m.total)
	}
	m.last, m.gaveUp = flags&flagLast != 0, gaveUp == 1
	if m.last && m.offset+uint64(m.length) != m.total {
		return errProto("last read part [%d, +%d) does not end the op of %d bytes", m.offset, m.length, m.total)
	}
	return nil
}

// appendMsg appends the encoding of m to b. It is the inverse of decodeMsg
// for every message decodeMsg accepts; m must be valid.
func appendMsg(b []byte, m *msg) []byte {
	start := len(b)
	b = append(b, m.typ, 0, 0, 0, 0, 0, 0, 0)
	be := binary.BigEndian
	switch m.typ {
	case msgHello:
		b = append(b, helloMagic...)
		b = append(b, m.version, 0, 0, 0)
	case msgWindow:
		b = be.AppendUint32(b, m.slotLen)
		b = be.AppendUint32(b, m.slots)
	case msgCancel:
		b = be.AppendUint64(b, m.op)
		b = be.AppendUint64(b, m.seq)
	case msgPost, msgIdle:
		b = be.AppendUint64(b, m.seq)
	case msgDone, msgProbe:
		b = be.AppendUint64(b, m.op)
	case msgAbort:
		b = be.AppendUint64(b, m.tag)
	case msgRelease:
		b = be.AppendUint32(b, m.slot)
		b = be.AppendUint32(b, 0)
	case msgErr:
		text := m.text
		if len(text) > maxErrText {
			text = text[:maxErrText]
		}
		b = be.AppendUint64(b, m.op)
		b = be.AppendUint32(b, m.code)
		b = be.AppendUint32(b, uint32(len(text)))
		b = append(b, text...)
	case msgProbeOK:
		b = be.AppendUint64(b, m.op)
		b = be.AppendUint64(b, m.nonce)
	default:
		panic(fmt.Sprintf("shm: encoding message type %d", m.typ))
	}
	be.PutUint32(b[start+4:], uint32(len(b)-start-hdrLen))
	return b
}

// descFormat is the layout of this backend's descriptors (see above).
var descFormat = &receipt.Format{
	Backend: "shm",
	Header:  []byte{descKind, descVersion},
	CheckHeader: func(b []byte) error {
		switch {
		case b[0] != descKind:
			return fmt.Errorf("kind %#x, want %#x (not an shm descriptor)", b[0], descKind)
		case len(b) < 2:
			return fmt.Errorf("truncated: %d bytes", len(b))
		case b[1] != descVersion:
			return fmt.Errorf("version %d, want %d", b[1], descVersion)
		}
		return nil
	},
	CheckEndpoint: checkEndpoint,
}

// checkEndpoint accepts exactly the endpoints Open makes: the prefix and 32
// lower-case hex digits. Nothing else is dialled, so that a descriptor from
// the wire cannot point a sender at an arbitrary socket.
func checkEndpoint(ep string) error {
	if len(ep) != endpointLen || ep[:len(endpointPrefix)] != endpointPrefix {
		return fmt.Errorf("endpoint %q is not an shm endpoint (%s and 32 hex digits)", ep, endpointPrefix)
	}
	for _, c := range []byte(ep[len(endpointPrefix):]) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return fmt.Errorf("endpoint %q is not an shm endpoint (%s and 32 hex digits)", ep, endpointPrefix)
		}
	}
	return nil
}
