package transceiver

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"
)

// The group protocol: the messages the processes of one instance exchange
// to agree on its requests (see Group). The same messages are a
// GatherGroup's contributions to a round and a CoordinatedGroup's frames.
//
// A message is a version byte (groupVersion), a type byte and a payload of
// uvarints, zig-zag varints and length-prefixed strings, each bounded
// before anything is allocated; a whole message is at most maxGroupMsg
// bytes. A CoordinatedGroup frames each with a 4-byte little-endian length.
//
//	join    {ranks, endpoint of each, 32-byte share of the instance secret}
//	joined  {the joins of every process, in process order}   coordinator → all
//	batch   {process, events}: a piece of the instance's log
//
// An event names its request by side and id and carries the fields of the
// consensus core's event; an error travels as a code (the sentinel it
// wraps, see errCodes) and its message.

const (
	groupVersion    = 1
	maxGroupMsg     = 4 << 20
	maxGroupRanks   = 1 << 12 // ranks in a list
	maxGroupEvents  = 1 << 16 // events in a batch
	maxGroupProcs   = 1 << 12
	maxEndpointLen  = 256
	maxErrMsgLen    = 1024
	maxBackendLen   = 16
	groupShareBytes = 32
)

type groupMsgType uint8

const (
	groupMsgJoin groupMsgType = 1 + iota
	groupMsgJoined
	groupMsgBatch
)

// Event kinds of a batch.
const (
	evKindBegin = 1 + iota
	evKindDone
	evKindAttempt
	evKindStartFailed
	evKindCancel
	evKindRanksLost
)

// ErrBadGroupMessage: a group message does not decode.
var ErrBadGroupMessage = errors.New("transceiver: malformed group message")

// groupJoin is what a process contributes to the join.
type groupJoin struct {
	ranks     []int
	endpoints []string // endpoints[i] is the control endpoint of ranks[i]
	share     [groupShareBytes]byte
}

// groupMsg is one decoded message: one of join, joins (joined) or the
// process and events of a batch.
type groupMsg struct {
	typ    groupMsgType
	join   groupJoin
	joins  []groupJoin
	proc   int
	events []instEvent
}

// errCodes are the sentinels an error crossing processes keeps: a decoded
// error wraps the sentinel of its code.
var errCodes = []error{nil, ErrCanceled, ErrTimeout, ErrRefused, ErrPeerLost, ErrPeerAborted, ErrTooManyAttempts, ErrClosed, ErrGroupLost, ErrPromptMismatch}

const errCodeOther = 255

// remoteError is an error of another process: its message, and the
// sentinel it wrapped there.
type remoteError struct {
	kind error
	msg  string
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.kind }

func appendErr(b []byte, err error) []byte {
	if err == nil {
		return append(b, 0)
	}
	code := byte(errCodeOther)
	for i, s := range errCodes[1:] {
		if errors.Is(err, s) {
			code = byte(i + 1)
			break
		}
	}
	msg := err.Error()
	if len(msg) > maxErrMsgLen {
		msg = msg[:maxErrMsgLen]
	}
	b = append(b, code)
	return appendBytes(b, []byte(msg))
}

func appendBytes(b, v []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

func appendInts(b []byte, v []int) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	for _, x := range v {
		b = binary.AppendUvarint(b, uint64(x))
	}
	return b
}

func appendTime(b []byte, t time.Time) []byte {
	if t.IsZero() {
		return binary.AppendVarint(b, 0)
	}
	return binary.AppendVarint(b, t.UnixNano())
}

func appendKey(b []byte, k instKey) []byte {
	b = append(b, byte(k.side))
	return binary.AppendUvarint(b, k.id)
}

func appendJoin(b []byte, j groupJoin) []byte {
	b = appendInts(b, j.ranks)
	b = binary.AppendUvarint(b, uint64(len(j.endpoints)))
	for _, e := range j.endpoints {
		b = appendBytes(b, []byte(e))
	}
	return append(b, j.share[:]...)
}

// encodeJoin encodes a join message.
func encodeJoin(j groupJoin) []byte {
	return appendJoin([]byte{groupVersion, byte(groupMsgJoin)}, j)
}

// encodeJoined encodes the joins of every process, in process order.
func encodeJoined(js []groupJoin) []byte {
	b := []byte{groupVersion, byte(groupMsgJoined)}
	b = binary.AppendUvarint(b, uint64(len(js)))
	for _, j := range js {
		b = appendJoin(b, j)
	}
	return b
}

// encodeBatch encodes events of process proc. It fails only for an event
// the log does not carry (a programmer's error) or a batch too large.
func encodeBatch(proc int, evs []instEvent) ([]byte, error) {
	if len(evs) > maxGroupEvents {
		return nil, fmt.Errorf("transceiver: group batch of %d events, at most %d", len(evs), maxGroupEvents)
	}
	b := []byte{groupVersion, byte(groupMsgBatch)}
	b = binary.AppendUvarint(b, uint64(proc))
	b = binary.AppendUvarint(b, uint64(len(evs)))
	for _, ev := range evs {
		switch ev := ev.(type) {
		case joinBeginEvent:
			b = append(b, evKindBegin)
			b = appendKey(b, ev.key)
			b = appendInts(b, ev.ranks)
			b = appendTime(b, ev.now)
		case rankDoneEvent:
			b = append(b, evKindDone)
			b = appendKey(b, ev.key)
			b = binary.AppendUvarint(b, uint64(ev.rank))
			b = appendErr(b, ev.err)
			b = binary.AppendUvarint(b, uint64(max(ev.res.bytes, 0)))
			b = binary.AppendUvarint(b, uint64(max(ev.res.chunks, 0)))
			be := ev.res.backend
			if len(be) > maxBackendLen {
				be = be[:maxBackendLen]
			}
			b = appendBytes(b, []byte(be))
			b = appendTime(b, ev.res.end)
			b = appendTime(b, ev.now)
		case attemptEndEvent:
			b = append(b, evKindAttempt)
			b = appendKey(b, ev.key)
			b = binary.AppendUvarint(b, uint64(ev.rank))
			b = binary.AppendUvarint(b, ev.attempt)
			b = appendErr(b, ev.err)
		case startFailedEvent:
			b = append(b, evKindStartFailed)
			b = appendKey(b, ev.key)
			b = appendInts(b, ev.ranks)
			b = appendErr(b, ev.err)
			b = appendTime(b, ev.now)
		case instCancelEvent:
			b = append(b, evKindCancel)
			b = appendKey(b, ev.key)
			b = appendErr(b, ev.cause)
		case ranksLostEvent:
			b = append(b, evKindRanksLost)
			b = appendInts(b, ev.ranks)
			b = appendErr(b, ev.err)
			b = appendTime(b, ev.now)
		default:
			panic(fmt.Sprintf("transceiver: group log: event %T does not travel", ev))
		}
	}
	if len(b) > maxGroupMsg {
		return nil, fmt.Errorf("transceiver: group batch of %d bytes, at most %d", len(b), maxGroupMsg)
	}
	return b, nil
}

// decodeGroupMsg decodes one message. Every error wraps ErrBadGroupMessage
// and names the field and the byte offset.
func decodeGroupMsg(b []byte) (*groupMsg, error) {
	if len(b) > maxGroupMsg {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrBadGroupMessage, len(b), maxGroupMsg)
	}
	if len(b) < 2 {
		return nil, fmt.Errorf("%w: %d bytes, a message has at least 2", ErrBadGroupMessage, len(b))
	}
	if b[0] != groupVersion {
		return nil, fmt.Errorf("%w: version %d, this build speaks %d", ErrBadGroupMessage, b[0], groupVersion)
	}
	d := &gdecoder{buf: b, off: 2}
	m := &groupMsg{typ: groupMsgType(b[1])}
	switch m.typ {
	case groupMsgJoin:
		m.join = d.join("join")
	case groupMsgJoined:
		n := int(d.uvarint("joined.count", maxGroupProcs))
		for i := 0; i < n && d.err == nil; i++ {
			m.joins = append(m.joins, d.join(fmt.Sprintf("joined[%d]", i)))
		}
	case groupMsgBatch:
		m.proc = int(d.uvarint("batch.process", maxGroupProcs))
		n := int(d.uvarint("batch.count", maxGroupEvents))
		for i := 0; i < n && d.err == nil; i++ {
			if ev := d.event(fmt.Sprintf("batch.event[%d]", i)); d.err == nil {
				m.events = append(m.events, ev)
			}
		}
	default:
		return nil, fmt.Errorf("%w: unknown message type %d", ErrBadGroupMessage, b[1])
	}
	if d.err == nil && d.off != len(b) {
		d.fail("end", fmt.Sprintf("%d trailing bytes", len(b)-d.off))
	}
	if d.err != nil {
		return nil, d.err
	}
	return m, nil
}

// gdecoder reads bounded fields and keeps the first error with its place.
type gdecoder struct {
	buf []byte
	off int
	err error
}

func (d *gdecoder) fail(field, why string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s at byte %d: %s", ErrBadGroupMessage, field, d.off, why)
	}
}

func (d *gdecoder) uvarint(field string, max uint64) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.buf[d.off:])
	if n <= 0 {
		d.fail(field, "truncated or overlong varint")
		return 0
	}
	if v > max {
		d.fail(field, fmt.Sprintf("value %d exceeds %d", v, max))
		return 0
	}
	d.off += n
	return v
}

func (d *gdecoder) time(field string) time.Time {
	if d.err != nil {
		return time.Time{}
	}
	v, n := binary.Varint(d.buf[d.off:])
	if n <= 0 {
		d.fail(field, "truncated or overlong varint")
		return time.Time{}
	}
	d.off += n
	if v == 0 {
		return time.Time{}
	}
	return time.Unix(0, v)
}

func (d *gdecoder) byte(field string) byte {
	if d.err != nil {
		return 0
	}
	if d.off >= len(d.buf) {
		d.fail(field, "truncated")
		return 0
	}
	d.off++
	return d.buf[d.off-1]
}

func (d *gdecoder) bytes(field string, max int) []byte {
	n := int(d.uvarint(field+".len", uint64(max)))
	if d.err != nil {
		return nil
	}
	if len(d.buf)-d.off < n {
		d.fail(field, fmt.Sprintf("length %d, only %d bytes left", n, len(d.buf)-d.off))
		return nil
	}
	out := d.buf[d.off : d.off+n : d.off+n]
	d.off += n
	return out
}

func (d *gdecoder) ints(field string) []int {
	n := int(d.uvarint(field+".count", maxGroupRanks))
	var out []int
	for i := 0; i < n && d.err == nil; i++ {
		out = append(out, int(d.uvarint(fmt.Sprintf("%s[%d]", field, i), maxGroupRanks-1)))
	}
	return out
}

func (d *gdecoder) key(field string) instKey {
	s := d.byte(field + ".side")
	if d.err == nil && s > byte(sideRecv) {
		d.fail(field+".side", fmt.Sprintf("side %d is neither send (0) nor recv (1)", s))
	}
	return instKey{side: side(s), id: d.uvarint(field+".id", 1<<64-1)}
}

func (d *gdecoder) errv(field string) error {
	code := d.byte(field + ".code")
	if d.err != nil || code == 0 {
		return nil
	}
	msg := string(d.bytes(field+".msg", maxErrMsgLen))
	if d.err != nil {
		return nil
	}
	if code == errCodeOther {
		return &remoteError{msg: msg}
	}
	if int(code) >= len(errCodes) {
		d.fail(field+".code", fmt.Sprintf("unknown error code %d", code))
		return nil
	}
	return &remoteError{kind: errCodes[code], msg: msg}
}

func (d *gdecoder) join(field string) groupJoin {
	var j groupJoin
	j.ranks = d.ints(field + ".ranks")
	n := int(d.uvarint(field+".endpoints.count", maxGroupRanks))
	if d.err == nil && n != len(j.ranks) {
		d.fail(field+".endpoints.count", fmt.Sprintf("%d endpoints for %d ranks", n, len(j.ranks)))
	}
	for i := 0; i < n && d.err == nil; i++ {
		j.endpoints = append(j.endpoints, string(d.bytes(fmt.Sprintf("%s.endpoints[%d]", field, i), maxEndpointLen)))
	}
	if d.err == nil && len(d.buf)-d.off < groupShareBytes {
		d.fail(field+".share", fmt.Sprintf("need %d bytes, have %d", groupShareBytes, len(d.buf)-d.off))
	}
	if d.err == nil {
		d.off += copy(j.share[:], d.buf[d.off:])
	}
	return j
}

func (d *gdecoder) event(field string) instEvent {
	switch kind := d.byte(field + ".kind"); kind {
	case evKindBegin:
		return joinBeginEvent{key: d.key(field + ".key"), ranks: d.ints(field + ".ranks"), now: d.time(field + ".now")}
	case evKindDone:
		ev := rankDoneEvent{key: d.key(field + ".key"), rank: int(d.uvarint(field+".rank", maxGroupRanks-1)), err: d.errv(field + ".err")}
		ev.res.bytes = int64(d.uvarint(field+".bytes", 1<<62))
		ev.res.chunks = int(d.uvarint(field+".chunks", 1<<31))
		ev.res.backend = string(d.bytes(field+".backend", maxBackendLen))
		ev.res.end = d.time(field + ".end")
		ev.now = d.time(field + ".now")
		return ev
	case evKindAttempt:
		return attemptEndEvent{key: d.key(field + ".key"), rank: int(d.uvarint(field+".rank", maxGroupRanks-1)),
			attempt: d.uvarint(field+".attempt", 1<<64-1), err: d.errv(field + ".err")}
	case evKindStartFailed:
		return startFailedEvent{key: d.key(field + ".key"), ranks: d.ints(field + ".ranks"), err: d.errv(field + ".err"), now: d.time(field + ".now")}
	case evKindCancel:
		return instCancelEvent{key: d.key(field + ".key"), cause: d.errv(field + ".cause")}
	case evKindRanksLost:
		return ranksLostEvent{ranks: d.ints(field + ".ranks"), err: d.errv(field + ".err"), now: d.time(field + ".now")}
	default:
		if d.err == nil {
			d.fail(field+".kind", fmt.Sprintf("unknown event kind %d", kind))
		}
		return nil
	}
}

// writeGroupFrame writes msg with its 4-byte length.
func writeGroupFrame(w io.Writer, msg []byte) error {
	b := make([]byte, 4, 4+len(msg))
	binary.LittleEndian.PutUint32(b, uint32(len(msg)))
	_, err := w.Write(append(b, msg...))
	return err
}

// readGroupFrame reads one length-prefixed message and decodes it.
func readGroupFrame(r io.Reader) (*groupMsg, error) {
	buf, err := readRawGroupFrame(r)
	if err != nil {
		return nil, err
	}
	return decodeGroupMsg(buf)
}

// readRawGroupFrame reads one length-prefixed frame, bounded.
func readRawGroupFrame(r io.Reader) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n < 2 || n > maxGroupMsg+64 {
		return nil, fmt.Errorf("%w: frame length %d not in 2..%d", ErrBadGroupMessage, n, maxGroupMsg+64)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(r, buf); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return buf, nil
}
