package transceiver

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/kvxfer/kvxfer/internal/wirefield"
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
	return wirefield.AppendBytes(b, []byte(msg))
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
		b = wirefield.AppendBytes(b, []byte(e))
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
			b = wirefield.AppendBytes(b, []byte(be))
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
	d := newGDecoder(b)
	m := &groupMsg{typ: groupMsgType(b[1])}
	switch m.typ {
	case groupMsgJoin:
		d.at = "join"
		m.join = d.join()
	case groupMsgJoined:
		n := int(d.Uvarint("joined.count", maxGroupProcs))
		d.at = "joined"
		for i := 0; i < n && d.Err == nil; i++ {
			d.idx = i
			m.joins = append(m.joins, d.join())
		}
	case groupMsgBatch:
		m.proc = int(d.Uvarint("batch.process", maxGroupProcs))
		n := int(d.Uvarint("batch.count", maxGroupEvents))
		d.at = "batch.event"
		m.events = make([]instEvent, 0, min(n, len(b)))
		for i := 0; i < n && d.Err == nil; i++ {
			d.idx = i
			if ev := d.event(); d.Err == nil {
				m.events = append(m.events, ev)
			}
		}
		d.at, d.idx = "", -1
	default:
		return nil, fmt.Errorf("%w: unknown message type %d", ErrBadGroupMessage, b[1])
	}
	if err := d.End(); err != nil {
		return nil, err
	}
	return m, nil
}

// gdecoder reads the bounded fields of one group message; its errors wrap
// ErrBadGroupMessage and name the place of the field and the byte.
type gdecoder struct {
	wirefield.Decoder
	// The place of the fields being read, named only on failure (so that
	// a message decodes without building names): at[idx] (idx ≥ 0), then
	// the field.
	at  string
	idx int
}

func newGDecoder(b []byte) *gdecoder {
	d := &gdecoder{idx: -1}
	d.Buf, d.Off = b, 2
	d.Wrap = func(field string, off int, why string) error {
		place := d.at
		if d.idx >= 0 {
			place = fmt.Sprintf("%s[%d]", d.at, d.idx)
		}
		return fmt.Errorf("%w: %s%s at byte %d: %s", ErrBadGroupMessage, place, field, off, why)
	}
	return d
}

// time reads a time written by appendTime.
func (d *gdecoder) time(field string) time.Time {
	v := d.Varint(field)
	if v == 0 {
		return time.Time{}
	}
	return time.Unix(0, v)
}

// ints reads a list of rank numbers; field and its element fields are
// the constants given (an element's failure names no index: the byte
// offset places it).
func (d *gdecoder) ints(count, elem string) []int {
	n := int(d.Uvarint(count, maxGroupRanks))
	if d.Err != nil || n == 0 {
		return nil
	}
	out := make([]int, 0, min(n, len(d.Buf)-d.Off))
	for i := 0; i < n && d.Err == nil; i++ {
		out = append(out, int(d.Uvarint(elem, maxGroupRanks-1)))
	}
	return out
}

func (d *gdecoder) key() instKey {
	s := d.Byte(".key.side")
	if d.Err == nil && s > byte(sideRecv) {
		d.Fail(".key.side", fmt.Sprintf("side %d is neither send (0) nor recv (1)", s))
	}
	return instKey{side: side(s), id: d.Uvarint(".key.id", 1<<64-1)}
}

func (d *gdecoder) errv(code, msg string) error {
	c := d.Byte(code)
	if d.Err != nil || c == 0 {
		return nil
	}
	m := string(d.Bytes(msg, maxErrMsgLen))
	if d.Err != nil {
		return nil
	}
	if c == errCodeOther {
		return &remoteError{msg: m}
	}
	if int(c) >= len(errCodes) {
		d.Fail(code, fmt.Sprintf("unknown error code %d", c))
		return nil
	}
	return &remoteError{kind: errCodes[c], msg: m}
}

func (d *gdecoder) join() groupJoin {
	var j groupJoin
	j.ranks = d.ints(".ranks.count", ".ranks[]")
	n := int(d.Uvarint(".endpoints.count", maxGroupRanks))
	if d.Err == nil && n != len(j.ranks) {
		d.Fail(".endpoints.count", fmt.Sprintf("%d endpoints for %d ranks", n, len(j.ranks)))
	}
	for i := 0; i < n && d.Err == nil; i++ {
		j.endpoints = append(j.endpoints, string(d.Bytes(".endpoints[]", maxEndpointLen)))
	}
	d.Fixed(".share", j.share[:])
	return j
}

func (d *gdecoder) event() instEvent {
	switch kind := d.Byte(".kind"); kind {
	case evKindBegin:
		return joinBeginEvent{key: d.key(), ranks: d.ints(".ranks.count", ".ranks[]"), now: d.time(".now")}
	case evKindDone:
		ev := rankDoneEvent{key: d.key(), rank: int(d.Uvarint(".rank", maxGroupRanks-1)), err: d.errv(".err.code", ".err.msg")}
		ev.res.bytes = int64(d.Uvarint(".bytes", 1<<62))
		ev.res.chunks = int(d.Uvarint(".chunks", 1<<31))
		ev.res.backend = string(d.Bytes(".backend", maxBackendLen))
		ev.res.end = d.time(".end")
		ev.now = d.time(".now")
		return ev
	case evKindAttempt:
		return attemptEndEvent{key: d.key(), rank: int(d.Uvarint(".rank", maxGroupRanks-1)),
			attempt: d.Uvarint(".attempt", 1<<64-1), err: d.errv(".err.code", ".err.msg")}
	case evKindStartFailed:
		return startFailedEvent{key: d.key(), ranks: d.ints(".ranks.count", ".ranks[]"), err: d.errv(".err.code", ".err.msg"), now: d.time(".now")}
	case evKindCancel:
		return instCancelEvent{key: d.key(), cause: d.errv(".cause.code", ".cause.msg")}
	case evKindRanksLost:
		return ranksLostEvent{ranks: d.ints(".ranks.count", ".ranks[]"), err: d.errv(".err.code", ".err.msg"), now: d.time(".now")}
	default:
		if d.Err == nil {
			d.Fail(".kind", fmt.Sprintf("unknown event kind %d", kind))
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
