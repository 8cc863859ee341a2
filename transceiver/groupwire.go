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

// encodeSome encodes as many of evs, from the first, as make a batch within
// the bounds (at least one: one event always fits), and says how many.
func encodeSome(proc int, evs []instEvent) ([]byte, int) {
	n := min(len(evs), maxGroupEvents)
	for {
		b, err := encodeBatch(proc, evs[:n])
		if err == nil || n <= 1 {
			if err != nil {
				panic(err) // one event is at most a few KiB
			}
			return b, n
		}
		n /= 2
	}
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
	d := &gdecoder{buf: b, off: 2, idx: -1}
	m := &groupMsg{typ: groupMsgType(b[1])}
	switch m.typ {
	case groupMsgJoin:
		d.at = "join"
		m.join = d.join()
	case groupMsgJoined:
		n := int(d.uvarint("joined.count", maxGroupProcs))
		d.at = "joined"
		for i := 0; i < n && d.err == nil; i++ {
			d.idx = i
			m.joins = append(m.joins, d.join())
		}
	case groupMsgBatch:
		m.proc = int(d.uvarint("batch.process", maxGroupProcs))
		n := int(d.uvarint("batch.count", maxGroupEvents))
		d.at = "batch.event"
		m.events = make([]instEvent, 0, min(n, len(b)))
		for i := 0; i < n && d.err == nil; i++ {
			d.idx = i
			if ev := d.event(); d.err == nil {
				m.events = append(m.events, ev)
			}
		}
		d.at, d.idx = "", -1
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
	// The place of the fields being read, named only on failure (so that
	// a message decodes without building names): at[idx] (idx ≥ 0), then
	// the field.
	at  string
	idx int
}

func (d *gdecoder) fail(field, why string) {
	if d.err == nil {
		place := d.at
		if d.idx >= 0 {
			place = fmt.Sprintf("%s[%d]", d.at, d.idx)
		}
		d.err = fmt.Errorf("%w: %s%s at byte %d: %s", ErrBadGroupMessage, place, field, d.off, why)
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
	n := int(d.uvarint(field, uint64(max)))
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

// ints reads a list of rank numbers; field and its element fields are
// the constants given (an element's failure names no index: the byte
// offset places it).
func (d *gdecoder) ints(count, elem string) []int {
	n := int(d.uvarint(count, maxGroupRanks))
	if d.err != nil || n == 0 {
		return nil
	}
	out := make([]int, 0, min(n, len(d.buf)-d.off))
	for i := 0; i < n && d.err == nil; i++ {
		out = append(out, int(d.uvarint(elem, maxGroupRanks-1)))
	}
	return out
}

func (d *gdecoder) key() instKey {
	s := d.byte(".key.side")
	if d.err == nil && s > byte(sideRecv) {
		d.fail(".key.side", fmt.Sprintf("side %d is neither send (0) nor recv (1)", s))
	}
	return instKey{side: side(s), id: d.uvarint(".key.id", 1<<64-1)}
}

func (d *gdecoder) errv(code, msg string) error {
	c := d.byte(code)
	if d.err != nil || c == 0 {
		return nil
	}
	m := string(d.bytes(msg, maxErrMsgLen))
	if d.err != nil {
		return nil
	}
	if c == errCodeOther {
		return &remoteError{msg: m}
	}
	if int(c) >= len(errCodes) {
		d.fail(code, fmt.Sprintf("unknown error code %d", c))
		return nil
	}
	return &remoteError{kind: errCodes[c], msg: m}
}

func (d *gdecoder) join() groupJoin {
	var j groupJoin
	j.ranks = d.ints(".ranks.count", ".ranks[]")
	n := int(d.uvarint(".endpoints.count", maxGroupRanks))
	if d.err == nil && n != len(j.ranks) {
		d.fail(".endpoints.count", fmt.Sprintf("%d endpoints for %d ranks", n, len(j.ranks)))
	}
	for i := 0; i < n && d.err == nil; i++ {
		j.endpoints = append(j.endpoints, string(d.bytes(".endpoints[]", maxEndpointLen)))
	}
	if d.err == nil && len(d.buf)-d.off < groupShareBytes {
		d.fail(".share", fmt.Sprintf("need %d bytes, have %d", groupShareBytes, len(d.buf)-d.off))
	}
	if d.err == nil {
		d.off += copy(j.share[:], d.buf[d.off:])
	}
	return j
}

func (d *gdecoder) event() instEvent {
	switch kind := d.byte(".kind"); kind {
	case evKindBegin:
		return joinBeginEvent{key: d.key(), ranks: d.ints(".ranks.count", ".ranks[]"), now: d.time(".now")}
	case evKindDone:
		ev := rankDoneEvent{key: d.key(), rank: int(d.uvarint(".rank", maxGroupRanks-1)), err: d.errv(".err.code", ".err.msg")}
		ev.res.bytes = int64(d.uvarint(".bytes", 1<<62))
		ev.res.chunks = int(d.uvarint(".chunks", 1<<31))
		ev.res.backend = string(d.bytes(".backend", maxBackendLen))
		ev.res.end = d.time(".end")
		ev.now = d.time(".now")
		return ev
	case evKindAttempt:
		return attemptEndEvent{key: d.key(), rank: int(d.uvarint(".rank", maxGroupRanks-1)),
			attempt: d.uvarint(".attempt", 1<<64-1), err: d.errv(".err.code", ".err.msg")}
	case evKindStartFailed:
		return startFailedEvent{key: d.key(), ranks: d.ints(".ranks.count", ".ranks[]"), err: d.errv(".err.code", ".err.msg"), now: d.time(".now")}
	case evKindCancel:
		return instCancelEvent{key: d.key(), cause: d.errv(".cause.code", ".cause.msg")}
	case evKindRanksLost:
		return ranksLostEvent{ranks: d.ints(".ranks.count", ".ranks[]"), err: d.errv(".err.code", ".err.msg"), now: d.time(".now")}
	default:
		if d.err == nil {
			d.fail(".kind", fmt.Sprintf("unknown event kind %d", kind))
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
