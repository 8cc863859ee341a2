package transceiver

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// sampleEvents are one event of every kind the log carries.
func sampleEvents() []instEvent {
	at := time.Unix(1700000000, 123456789)
	return []instEvent{
		joinBeginEvent{key: instKey{sideSend, 7}, ranks: []int{0, 1, 2, 3}, now: at},
		rankDoneEvent{key: instKey{sideRecv, 1<<63 + 5}, rank: 3, res: rankResult{bytes: 1 << 40, chunks: 17, backend: "tcp", end: at}, now: at},
		rankDoneEvent{key: instKey{sideSend, 7}, rank: 1, err: fmt.Errorf("%w: rank 1: deadline", ErrTimeout), now: at},
		attemptEndEvent{key: instKey{sideSend, 7}, rank: 2, attempt: 99, err: fmt.Errorf("%w: abort", ErrPeerAborted)},
		attemptEndEvent{key: instKey{sideSend, 7}, rank: 0, attempt: 99},
		startFailedEvent{key: instKey{sideRecv, 2}, ranks: []int{1}, err: errors.New("pool: no such block"), now: at},
		instCancelEvent{key: instKey{sideRecv, 2}, cause: fmt.Errorf("%w: request 2 cancelled", ErrCanceled)},
		ranksLostEvent{ranks: []int{4, 5}, err: fmt.Errorf("%w: process 2 left", ErrGroupLost), now: at},
	}
}

// reencode encodes a decoded message again.
func reencode(t testing.TB, m *groupMsg) []byte {
	t.Helper()
	switch m.typ {
	case groupMsgJoin:
		return encodeJoin(m.join)
	case groupMsgJoined:
		return encodeJoined(m.joins)
	case groupMsgBatch:
		b, err := encodeBatch(m.proc, m.events)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		return b
	}
	t.Fatalf("message type %d", m.typ)
	return nil
}

// TestGroupMsgRoundTrip: every message decodes to what was encoded, and
// errors keep their message and the sentinel they wrapped.
func TestGroupMsgRoundTrip(t *testing.T) {
	evs := sampleEvents()
	b, err := encodeBatch(3, evs)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeGroupMsg(b)
	if err != nil {
		t.Fatal(err)
	}
	if m.typ != groupMsgBatch || m.proc != 3 || len(m.events) != len(evs) {
		t.Fatalf("decoded %+v", m)
	}
	for i, ev := range m.events {
		if got, want := fmt.Sprint(normErrs(ev)), fmt.Sprint(normErrs(evs[i])); got != want {
			t.Errorf("event %d: got %s\nwant %s", i, got, want)
		}
	}
	for i, s := range []error{nil, ErrTimeout, ErrPeerAborted, nil, nil, ErrCanceled, ErrGroupLost} {
		var err error
		switch ev := m.events[i+1].(type) {
		case rankDoneEvent:
			err = ev.err
		case attemptEndEvent:
			err = ev.err
		case startFailedEvent:
			err = ev.err
		case instCancelEvent:
			err = ev.cause
		case ranksLostEvent:
			err = ev.err
		}
		if s != nil && !errors.Is(err, s) {
			t.Errorf("event %d: %v does not wrap %v", i+1, err, s)
		}
	}
	if !bytes.Equal(reencode(t, m), b) {
		t.Error("re-encoding differs")
	}
	j := groupJoin{ranks: []int{2, 3}, endpoints: []string{"10.0.0.1:5000", "10.0.0.1:5001"}, share: [32]byte{9, 8, 7}}
	jm, err := decodeGroupMsg(encodeJoin(j))
	if err != nil || fmt.Sprint(jm.join) != fmt.Sprint(j) {
		t.Fatalf("join: %+v %v", jm, err)
	}
	all, err := decodeGroupMsg(encodeJoined([]groupJoin{j, {ranks: []int{0}, endpoints: []string{"h:1"}}}))
	if err != nil || len(all.joins) != 2 || fmt.Sprint(all.joins[0]) != fmt.Sprint(j) {
		t.Fatalf("joined: %+v %v", all, err)
	}
}

// msgErr is an error's message, printed as such inside a struct.
type msgErr string

func (e msgErr) Error() string { return string(e) }

// normErrs replaces an event's error by its message, for comparison.
func normErrs(ev instEvent) instEvent {
	msg := func(err error) error {
		if err == nil {
			return nil
		}
		return msgErr(err.Error())
	}
	switch ev := ev.(type) {
	case rankDoneEvent:
		ev.err = msg(ev.err)
		return ev
	case attemptEndEvent:
		ev.err = msg(ev.err)
		return ev
	case startFailedEvent:
		ev.err = msg(ev.err)
		return ev
	case instCancelEvent:
		ev.cause = msg(ev.cause)
		return ev
	case ranksLostEvent:
		ev.err = msg(ev.err)
		return ev
	}
	return ev
}

// TestGroupMsgBad: what does not decode is refused with the field and the
// offset, before anything large is allocated.
func TestGroupMsgBad(t *testing.T) {
	good, _ := encodeBatch(1, sampleEvents())
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "at least 2"},
		{"version", []byte{9, 3, 0, 0}, "version 9"},
		{"type", []byte{groupVersion, 77}, "unknown message type 77"},
		{"truncated", good[:len(good)-3], "at byte"},
		{"trailing", append(append([]byte{}, good...), 0), "trailing"},
		{"too many events", []byte{groupVersion, byte(groupMsgBatch), 0, 0xff, 0xff, 0xff, 0x7f}, "batch.count"},
		{"unknown event", []byte{groupVersion, byte(groupMsgBatch), 0, 1, 42}, "unknown event kind 42"},
		{"bad side", []byte{groupVersion, byte(groupMsgBatch), 0, 1, evKindCancel, 5, 1, 0}, "neither send"},
		{"bad error code", []byte{groupVersion, byte(groupMsgBatch), 0, 1, evKindCancel, 0, 1, 200, 0}, "unknown error code 200"},
		{"huge ranks", []byte{groupVersion, byte(groupMsgJoin), 0xff, 0xff, 0x03}, "ranks.count"},
		{"endpoints mismatch", append([]byte{groupVersion, byte(groupMsgJoin), 1, 0, 2}, make([]byte, 40)...), "2 endpoints for 1 ranks"},
		{"long endpoint", []byte{groupVersion, byte(groupMsgJoin), 1, 0, 1, 0xff, 0x7f}, "exceeds 256"},
		{"oversize", make([]byte, maxGroupMsg+1), "at most"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeGroupMsg(tc.b)
			if !errors.Is(err, ErrBadGroupMessage) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decode: %v, want ErrBadGroupMessage with %q", err, tc.want)
			}
		})
	}
}

// FuzzDecodeGroupMsg: the decoder never panics, and what it accepts
// encodes back to a message that decodes the same.
func FuzzDecodeGroupMsg(f *testing.F) {
	good, _ := encodeBatch(1, sampleEvents())
	f.Add(good)
	f.Add(encodeJoin(groupJoin{ranks: []int{0, 1}, endpoints: []string{"a:1", "b:2"}}))
	f.Add(encodeJoined([]groupJoin{{ranks: []int{0}, endpoints: []string{"a:1"}}}))
	f.Add([]byte{groupVersion, byte(groupMsgBatch), 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeGroupMsg(b)
		if err != nil {
			if !errors.Is(err, ErrBadGroupMessage) {
				t.Fatalf("error %v does not wrap ErrBadGroupMessage", err)
			}
			return
		}
		again := reencode(t, m)
		m2, err := decodeGroupMsg(again)
		if err != nil {
			t.Fatalf("re-encoded message does not decode: %v", err)
		}
		if !bytes.Equal(reencode(t, m2), again) {
			t.Fatal("re-encoding is not stable")
		}
	})
}
