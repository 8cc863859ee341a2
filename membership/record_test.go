package membership

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func testRecord() Record {
	return Record{Role: RoleGeneration, URL: "http://10.0.0.7:8001", Model: "llama", Layout: Layout{TP: 2, PP: 1, DP: 1},
		LayoutFingerprint: "abc", Backends: []string{"UCX", "TCP"}, Incarnation: 0x1234, RegisteredAt: time.Unix(1700000000, 0).UTC()}
}

func TestRecordRoundTrip(t *testing.T) {
	r := testRecord()
	b, err := EncodeRecord(&r)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	if !cmp.Equal(*got, r) {
		t.Errorf("round trip: %s", cmp.Diff(r, *got))
	}
	// A newer worker's extra field is ignored.
	if _, err := DecodeRecord([]byte(strings.Replace(string(b), `{`, `{"future":1,`, 1))); err != nil {
		t.Errorf("record with an unknown field: %v", err)
	}
	id, _ := r.ID()
	if id != "10.0.0.7_8001-0000000000001234" {
		t.Errorf("ID = %q", id)
	}
	key := Key("prod", r.Role, id)
	if key != "/kvxfer/prod/workers/generation/10.0.0.7_8001-0000000000001234" {
		t.Errorf("Key = %q", key)
	}
	role, gotID, inc, err := ParseKey("prod", key)
	if err != nil || role != r.Role || gotID != id || inc != r.Incarnation {
		t.Errorf("ParseKey = %v %v %v %v", role, gotID, inc, err)
	}
	v6 := testRecord()
	v6.URL = "http://[fd00::1]:80"
	if id, err := v6.ID(); err != nil || id != "fd00__1_80-0000000000001234" {
		t.Errorf("IPv6 ID = %q, %v", id, err)
	}
}

func TestRecordValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Record)
		msg  string
	}{
		{"role", func(r *Record) { r.Role = "prefill" }, "role"},
		{"no port", func(r *Record) { r.URL = "http://h" }, "with a port"},
		{"path", func(r *Record) { r.URL = "http://h:1/x" }, "want http://host:port"},
		{"scheme", func(r *Record) { r.URL = "tcp://h:1" }, "want http://host:port"},
		{"unspecified", func(r *Record) { r.URL = "http://0.0.0.0:8000" }, "no address a peer can reach"},
		{"layout", func(r *Record) { r.Layout.PP = 0 }, "layout"},
		{"backends", func(r *Record) { r.Backends = make([]string, 17) }, "backends"},
		{"empty backend", func(r *Record) { r.Backends = []string{""} }, "backend"},
		{"incarnation", func(r *Record) { r.Incarnation = 0 }, "incarnation"},
		{"model", func(r *Record) { r.Model = strings.Repeat("m", 300) }, "model"},
		// Control characters would forge or hide rows of kvxfer cluster
		// status's table, or drive the operator's terminal.
		{"model newline", func(r *Record) { r.Model = "llama\ncontext\thttp://10.9.9.9:1" }, "model"},
		{"fingerprint tab", func(r *Record) { r.LayoutFingerprint = "abc\tdef" }, "layout_fingerprint"},
		{"backend escape", func(r *Record) { r.Backends = []string{"TCP\x1b[2J"} }, "backend"},
		{"model C1", func(r *Record) { r.Model = "llama\u0085" }, "model"},
	} {
		r := testRecord()
		tc.edit(&r)
		err := r.Validate()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: %v, want ErrInvalid containing %q", tc.name, err, tc.msg)
		}
	}
	if _, err := DecodeRecord(make([]byte, MaxRecordSize+1)); !errors.Is(err, ErrInvalid) {
		t.Errorf("oversized record: %v", err)
	}
	if _, err := DecodeRecord([]byte(`{"role":"context"} x`)); !errors.Is(err, ErrInvalid) {
		t.Errorf("trailing data: %v", err)
	}
}

func TestParseKeyRefuses(t *testing.T) {
	for _, k := range []string{
		"/kvxfer/other/workers/context/h_1-0000000000000001",
		"/kvxfer/c/workers/prefill/h_1-0000000000000001",
		"/kvxfer/c/workers/context/h_1",
		"/kvxfer/c/workers/context/h_1-00000000000000zz",
		"/kvxfer/c/workers/context/a/h_1-0000000000000001",
		"/kvxfer/c/workers/context",
	} {
		if _, _, _, err := ParseKey("c", k); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseKey(%q): %v, want ErrInvalid", k, err)
		}
	}
}

func TestNewMemberChecks(t *testing.T) {
	r := testRecord()
	if _, err := NewMember(nil, r, MemberOptions{Interval: 6 * time.Second, TTL: 10 * time.Second}); !errors.Is(err, ErrInvalid) {
		t.Errorf("interval over ttl/2: %v", err)
	}
	r.URL = "http://0.0.0.0:1"
	if _, err := NewMember(nil, r, MemberOptions{Interval: time.Second, TTL: 10 * time.Second}); !errors.Is(err, ErrInvalid) {
		t.Errorf("unspecified address: %v", err)
	}
}

// FuzzDecodeRecord: no stored value makes the decoder panic; a value it
// accepts is valid and encodes again.
func FuzzDecodeRecord(f *testing.F) {
	r := testRecord()
	b, _ := EncodeRecord(&r)
	f.Add(b)
	f.Add([]byte(`{"role":"context","url":"http://[::1]:1","layout":{"tp":1,"pp":1,"dp":1},"incarnation":1}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRecord(b)
		if err != nil {
			return
		}
		if _, err := EncodeRecord(r); err != nil {
			t.Fatalf("accepted %q, which does not encode: %v", b, err)
		}
		if _, err := r.ID(); err != nil {
			t.Fatalf("accepted %q without an id: %v", b, err)
		}
	})
}

// FuzzParseKey: a key that parses is rebuilt by Key.
func FuzzParseKey(f *testing.F) {
	f.Add("c", "/kvxfer/c/workers/context/h_1-0000000000000001")
	f.Add("", "/kvxfer//workers/generation/x-ffffffffffffffff")
	f.Fuzz(func(t *testing.T, cluster, key string) {
		role, id, _, err := ParseKey(cluster, key)
		if err != nil {
			return
		}
		if got := Key(cluster, role, id); got != key {
			t.Fatalf("ParseKey(%q, %q) = %v %v; Key gives %q", cluster, key, role, id, got)
		}
	})
}
