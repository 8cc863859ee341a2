package wire

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/google/go-cmp/cmp"
)

func samples() []Frame {
	return []Frame{
		&Hello{Version: Version, Rank: 3, State: []byte{1, 2, 3}, Host: "host-a", Backends: []string{"tcp", "shm"}, Endpoints: []string{"127.0.0.1:9", "@kvxfer-shm-1"}},
		&Hello{},
		&RequestInfo{CtxRequestID: 1<<63 + 5, Token: [16]byte{1, 2, 3, 15: 9}, GenRequestID: 77, GenRank: 5,
			GenState: []byte{9, 9}, NumBlocks: 128, HasLastHash: true, LastHash: [16]byte{0: 4, 15: 1}, PromptDigest: [16]byte{0: 8, 15: 3}, MaxChunkBlocks: 16,
			Backend: "tcp", Desc: []byte("desc")},
		&RequestInfo{CtxRequestID: 1, NumBlocks: 1, Backend: "tcp"},
		&Ready{CtxRequestID: 1, GenRequestID: 2, ChunkBlocks: 64},
		&Refused{CtxRequestID: 1, GenRequestID: 2, Code: RefusedIncompatible, Reason: "layout: incompatible: dtype ctx=bf16 gen=fp16"},
		&ChunkDesc{CtxRequestID: 1, GenRequestID: 2, Index: 7, Desc: bytes.Repeat([]byte{7}, 100)},
		&Abort{CtxRequestID: 1, GenRequestID: 2, Reason: "cancelled"},
		&Ping{Nonce: 42},
		&Pong{Nonce: 42},
	}
}

func TestRoundTrip(t *testing.T) {
	var stream bytes.Buffer
	for _, f := range samples() {
		if err := Write(&stream, f); err != nil {
			t.Fatalf("Write %s: %v", f.Type(), err)
		}
	}
	r := bufio.NewReader(&stream)
	for _, want := range samples() {
		got, err := Read(r)
		if err != nil {
			t.Fatalf("Read %s: %v", want.Type(), err)
		}
		if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b []byte) bool { return bytes.Equal(a, b) })); diff != "" {
			t.Errorf("%s round trip (-want +got):\n%s", want.Type(), diff)
		}
	}
	if _, err := Read(r); err != io.EOF {
		t.Errorf("after the last frame: %v, want EOF", err)
	}
}

func TestLongReasonIsTruncated(t *testing.T) {
	b, err := Append(nil, &Abort{Reason: strings.Repeat("x", 3*MaxReason)})
	if err != nil {
		t.Fatal(err)
	}
	f, err := Decode(b[4:])
	if err != nil {
		t.Fatal(err)
	}
	if n := len(f.(*Abort).Reason); n != MaxReason {
		t.Errorf("reason length %d, want %d", n, MaxReason)
	}
}

func TestMalformed(t *testing.T) {
	frame := func(body ...byte) []byte {
		var b [4]byte
		binary.LittleEndian.PutUint32(b[:], uint32(len(body)))
		return append(b[:], body...)
	}
	ok, _ := Append(nil, &Ready{CtxRequestID: 1, GenRequestID: 2, ChunkBlocks: 3})
	tests := []struct {
		name, in, want string
	}{
		{"zero length", string(frame()), "length 0 not in 1..262144"},
		{"huge length", "\xff\xff\xff\x7f", "length 2147483647"},
		{"unknown type", string(frame(99)), "unknown frame type 99"},
		{"truncated varint", string(frame(byte(TypeReady), 0x80)), "ready.ctx_request_id at byte 1: truncated"},
		{"trailing", string(append(ok[:len(ok):len(ok)], 0)), ""}, // length prefix still says 4: the extra byte is the next frame
		{"trailing in frame", string(frame(byte(TypeReady), 1, 2, 3, 4)), "ready.end at byte 4: 1 trailing bytes"},
		{"blob too long", string(frame(byte(TypeChunkDesc), 1, 2, 3, 0xff, 0xff, 0x03)), "chunk-desc.desc.len at byte 4: value 65535 exceeds 8192"},
		{"blob past end", string(frame(byte(TypeChunkDesc), 1, 2, 3, 10, 1)), "chunk-desc.desc at byte 5: length 10, only 1 bytes left"},
		{"bad bool", string(frame(append(append([]byte{byte(TypeRequestInfo), 1}, make([]byte, 16)...), 1, 1, 0, 1, 2)...)), "has_last_hash"},
		{"too many backends", string(frame(byte(TypeHello), 1, 0, 0, 0, 17)), "hello.backends at byte 5: value 17 exceeds 16"},
		{"short token", string(frame(byte(TypeRequestInfo), 1, 2, 3)), "request-info.token at byte 2: need 16 bytes, have 2"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Read(bufio.NewReader(strings.NewReader(tc.in)))
			if tc.want == "" {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want it to contain %q", err, tc.want)
			}
			if strings.Contains(tc.want, "at byte") || strings.Contains(tc.want, "unknown") || strings.Contains(tc.want, "length") {
				if !errors.Is(err, ErrMalformed) {
					t.Errorf("%v does not wrap ErrMalformed", err)
				}
			}
		})
	}
}

// FuzzDecode: no panic on any input, and whatever decodes re-encodes to the
// same bytes (the encoding is canonical).
func FuzzDecode(f *testing.F) {
	for _, s := range samples() {
		b, _ := Append(nil, s)
		f.Add(b[4:])
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		fr, err := Decode(body)
		if err != nil {
			return
		}
		b, err := Append(nil, fr)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if !bytes.Equal(b[4:], body) {
			// Non-canonical varints (e.g. 0x80 0x00) decode but re-encode
			// shorter; anything else is a bug.
			fr2, err := Decode(b[4:])
			if err != nil || !cmp.Equal(fr, fr2, cmp.Comparer(func(a, b []byte) bool { return bytes.Equal(a, b) })) {
				t.Fatalf("re-encoding changed the frame: %v", err)
			}
		}
	})
}

// TestAnnouncedLengthNotAllocated: a header that announces a MaxFrame
// frame, followed by a few bytes and nothing more (a peer that stalls
// inside its first frame, before any hello), costs the reader about what
// arrived, not MaxFrame: otherwise every connection a stranger opens buys
// 256 KiB for 4 bytes, for the whole handshake or frame timeout.
func TestAnnouncedLengthNotAllocated(t *testing.T) {
	var hdr [4]byte
	binary.LittleEndian.PutUint32(hdr[:], MaxFrame)
	in := append(hdr[:], byte(TypeHello), 1, 2, 3)
	const runs = 16
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range runs {
		if _, err := Read(bufio.NewReaderSize(bytes.NewReader(in), 16)); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("Read of a truncated frame: %v, want io.ErrUnexpectedEOF", err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > MaxFrame/8 {
		t.Errorf("a header announcing %d bytes and 4 bytes of body cost %d bytes of allocation per read, want at most %d", MaxFrame, per, MaxFrame/8)
	}
}

// TestReadLargeFrameInPieces: a frame near MaxFrame that arrives a byte at
// a time reads whole and equal.
func TestReadLargeFrameInPieces(t *testing.T) {
	h := &Hello{Version: Version, Rank: 1, State: bytes.Repeat([]byte{5}, MaxBlob), Host: strings.Repeat("h", MaxName)}
	for i := range MaxBackends {
		h.Backends = append(h.Backends, strings.Repeat(string(rune('a'+i)), MaxName))
		h.Endpoints = append(h.Endpoints, strings.Repeat(string(rune('A'+i)), MaxBlob))
	}
	b, err := Append(nil, h)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < MaxFrame/2 {
		t.Fatalf("frame of %d bytes: not large enough to test", len(b))
	}
	got, err := Read(bufio.NewReaderSize(iotest.OneByteReader(bytes.NewReader(b)), 16))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(Frame(h), got); diff != "" {
		t.Errorf("large hello (-want +got):\n%s", diff)
	}
}

// FuzzRead: the stream reader never panics, reads at most what it is given,
// and every frame it returns is the one Decode gives for its bytes.
func FuzzRead(f *testing.F) {
	var all []byte
	for _, s := range samples() {
		b, _ := Append(nil, s)
		f.Add(b)
		f.Add(b[:len(b)-1])
		all = append(all, b...)
	}
	f.Add(all)
	f.Add([]byte{0xff, 0xff, 0x03, 0x00, byte(TypeHello)})
	f.Fuzz(func(t *testing.T, in []byte) {
		br := bytes.NewReader(in)
		r := bufio.NewReaderSize(br, 16)
		off := 0
		for {
			fr, err := Read(r)
			if err != nil {
				return
			}
			n := int(binary.LittleEndian.Uint32(in[off:]))
			want, err := Decode(in[off+4 : off+4+n])
			if err != nil {
				t.Fatalf("Read returned %s, Decode of the same bytes fails: %v", fr.Type(), err)
			}
			if diff := cmp.Diff(want, fr, cmp.Comparer(func(a, b []byte) bool { return bytes.Equal(a, b) })); diff != "" {
				t.Fatalf("Read and Decode differ (-decode +read):\n%s", diff)
			}
			off += 4 + n
			if off != len(in)-br.Len()-r.Buffered() {
				t.Fatalf("after a frame ending at byte %d the reader is at byte %d", off, len(in)-br.Len()-r.Buffered())
			}
		}
	})
}
