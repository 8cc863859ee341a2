package ucx

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/transport"
)

func testEndpoint() []byte {
	return encodeEndpoint(0x0123456789abcdef, bytes.Repeat([]byte{7}, 215))
}

func TestDescriptorRoundTrip(t *testing.T) {
	for _, d := range []descriptor{
		{tagBase: 0xabcd0000, total: 1, groups: []int64{1}, endpoint: testEndpoint()},
		{tagBase: 1 << 40, total: 300 << 20, groups: []int64{100 << 20, 200 << 20}, endpoint: testEndpoint()},
	} {
		b := d.encode()
		got, err := decodeDescriptor(b)
		if err != nil {
			t.Fatalf("decode(encode(%+v)): %v", d, err)
		}
		if got.tagBase != d.tagBase || got.total != d.total || !slices.Equal(got.groups, d.groups) || !bytes.Equal(got.endpoint, d.endpoint) {
			t.Fatalf("round trip: got %+v, want %+v", got, d)
		}
	}
}

func TestDescriptorRejects(t *testing.T) {
	good := descriptor{tagBase: 0x10000, total: 10, groups: []int64{4, 6}, endpoint: testEndpoint()}
	mut := func(f func(d *descriptor)) []byte {
		d := good
		d.groups = slices.Clone(good.groups)
		f(&d)
		return d.encode()
	}
	bad := map[string][]byte{
		"nil":        nil,
		"index bits": mut(func(d *descriptor) { d.tagBase |= 3 }),
		"sum":        mut(func(d *descriptor) { d.total = 11 }),
		"zero group": mut(func(d *descriptor) { d.groups = []int64{0, 10} }),
		"no groups":  mut(func(d *descriptor) { d.groups = nil }),
		"no address": mut(func(d *descriptor) { d.endpoint = d.endpoint[:endpointHeader] }),
		"ep version": mut(func(d *descriptor) { d.endpoint = append([]byte{9}, d.endpoint[1:]...) }),
		// Version 1 transports use UCX's 64 KiB tcp receive buffers; this
		// one's 1 MiB messages would abort them.
		"ep version 1": mut(func(d *descriptor) { d.endpoint = append([]byte{1}, d.endpoint[1:]...) }),
		"zero total":   mut(func(d *descriptor) { d.total = 0; d.groups = nil }),
		"trailing":     append(good.encode(), 0),
		"padded vint":  append(append(append([]byte{}, good.encode()[:12]...), 0x8a, 0x00), good.encode()[13:]...),
	}
	for name, b := range bad {
		if _, err := decodeDescriptor(b); !errors.Is(err, transport.ErrBadDescriptor) {
			t.Errorf("%s: decode = %v, want ErrBadDescriptor", name, err)
		}
	}
}

func TestCtrlRoundTrip(t *testing.T) {
	for _, m := range []ctrlMsg{
		{typ: ctrlHello, inst: 0x0123456789abcdef, payload: testEndpoint()},
		{typ: ctrlBye, inst: 5},
		{typ: ctrlAbort, inst: 5, a: 1 << 20, b: 9},
		{typ: ctrlAck, inst: 5, a: 9, b: ackCompleted},
	} {
		got, err := decodeCtrl(m.encode())
		if err != nil {
			t.Fatalf("decode(encode(%+v)): %v", m, err)
		}
		if got.typ != m.typ || got.inst != m.inst || got.a != m.a || got.b != m.b || !bytes.Equal(got.payload, m.payload) {
			t.Fatalf("round trip: got %+v, want %+v", got, m)
		}
	}
	for name, m := range map[string]ctrlMsg{
		"hello of another": {typ: ctrlHello, inst: 1, payload: testEndpoint()},
		"bye with payload": {typ: ctrlBye, payload: []byte{1}},
		"bad ack":          {typ: ctrlAck, b: 7},
		"unknown type":     {typ: 99},
	} {
		if _, err := decodeCtrl(m.encode()); err == nil {
			t.Errorf("%s: decoded", name)
		}
	}
}

func TestPlanGroups(t *testing.T) {
	const K, M = 1 << 10, 1 << 20
	tests := []struct {
		name  string
		sizes []int
		limit int
		want  [][2]int
	}{
		{"one", []int{5}, 512, [][2]int{{0, 1}}},
		{"kv blocks", []int{M, M, M}, 512, [][2]int{{0, 1}, {1, 2}, {2, 3}}},
		{"small gathered", []int{K, 0, K, K}, 512, [][2]int{{0, 4}}},
		{"small then big", []int{K, K, M, K}, 512, [][2]int{{0, 2}, {2, 3}, {3, 4}}},
		{"leading empty", []int{0, 0, M}, 512, [][2]int{{2, 3}}},
		{"small closes at 4MiB", []int{3 * M / 2 / 8, 3 * M, 200 * K, 200 * K}, 512, [][2]int{{0, 1}, {1, 2}, {2, 4}}},
		{"merged to limit", []int{M, M, M, M, M}, 2, [][2]int{{0, 4}, {4, 5}}},
	}
	for _, tt := range tests {
		got := planGroups(tt.sizes, tt.limit)
		if !slices.Equal(got, tt.want) {
			t.Errorf("%s: planGroups(%v) = %v, want %v", tt.name, tt.sizes, got, tt.want)
		}
	}
}

func TestSplitPieces(t *testing.T) {
	src := [][]byte{[]byte("abc"), nil, []byte("defgh"), []byte("i")}
	got := splitPieces(src, []int64{2, 5, 2})
	want := [][]string{{"ab"}, {"c", "defg"}, {"h", "i"}}
	if len(got) != len(want) {
		t.Fatalf("got %d groups", len(got))
	}
	for i := range want {
		var g []string
		for _, p := range got[i] {
			g = append(g, string(p))
		}
		if !slices.Equal(g, want[i]) {
			t.Errorf("group %d = %q, want %q", i, g, want[i])
		}
	}
}

func TestParseLanes(t *testing.T) {
	info := `#
# UCP endpoint
#
#               peer: <no debug data>
#                 lane[0]:  3:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] am am_bw#0 keepalive
#                 lane[1]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0
#                 lane[2]:  6:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#1
#
#                tag_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)
`
	if got := parseLanes(info); !slices.Equal(got, []string{"sysv", "cma"}) {
		t.Fatalf("parseLanes = %v", got)
	}
	if got := parseLanes("#  lane[0]:  2:tcp/lo.0 md[1] -> md[1]/tcp/sysdev[255] am am_bw#0 keepalive wireup"); !slices.Equal(got, []string{"tcp"}) {
		t.Fatalf("parseLanes(tcp) = %v", got)
	}
	if got := parseLanes("#  lane[0]:  1:rc_mlx5/mlx5_0:1.0 md[1] -> am"); !slices.Equal(got, []string{"rc_mlx5"}) {
		t.Fatalf("parseLanes(rc) = %v", got)
	}
}

// FuzzDecodeDescriptor: the decoder never panics, rejects with
// ErrBadDescriptor, and accepts only what it would encode itself.
func FuzzDecodeDescriptor(f *testing.F) {
	f.Add((&descriptor{tagBase: 0x10000, total: 10, groups: []int64{4, 6}, endpoint: testEndpoint()}).encode())
	f.Add((&descriptor{tagBase: 0, total: 1, groups: []int64{1}, endpoint: encodeEndpoint(1, []byte{1})}).encode())
	f.Add([]byte("KU\x01\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := decodeDescriptor(b)
		if err != nil {
			if !errors.Is(err, transport.ErrBadDescriptor) {
				t.Fatalf("error %v does not wrap ErrBadDescriptor", err)
			}
			return
		}
		if !bytes.Equal(d.encode(), b) {
			t.Fatalf("accepted a non-canonical descriptor")
		}
		var sum int64
		for _, g := range d.groups {
			if g <= 0 {
				t.Fatalf("group of %d bytes", g)
			}
			sum += g
		}
		if sum != d.total || len(d.groups) > maxGroups || d.tagBase&indexMask != 0 {
			t.Fatalf("accepted an inconsistent descriptor %+v", d)
		}
	})
}

// FuzzDecodeCtrl: the control-message decoder never panics and round-trips
// what it accepts.
func FuzzDecodeCtrl(f *testing.F) {
	f.Add((&ctrlMsg{typ: ctrlHello, inst: 0x0123456789abcdef, payload: testEndpoint()}).encode())
	f.Add((&ctrlMsg{typ: ctrlAbort, inst: 5, a: 1 << 20, b: 9}).encode())
	f.Add((&ctrlMsg{typ: ctrlAck, inst: 5, a: 9, b: ackAborted}).encode())
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeCtrl(b)
		if err != nil {
			return
		}
		if !bytes.Equal(m.encode(), b) {
			t.Fatalf("round trip differs")
		}
	})
}
