package ucx

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestBindDevices(t *testing.T) {
	ifs := []netIface{
		{"lo", []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")}},
		{"eth0", []netip.Addr{netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("fd00::2")}},
		{"eth1", []netip.Addr{netip.MustParseAddr("198.51.100.7")}},
	}
	rdma := []string{"mlx5_0:1"}
	for _, tc := range []struct {
		addr    string
		devices []string // nil: every device
		ipv6    bool
		err     string
	}{
		{addr: "127.0.0.1:0", devices: []string{"lo"}},
		{addr: "[::1]:0", devices: []string{"lo"}, ipv6: true},
		{addr: "192.0.2.2:0", devices: []string{"eth0", "mlx5_0:1"}},
		{addr: "[fd00::2]:0", devices: []string{"eth0", "mlx5_0:1"}, ipv6: true},
		{addr: "198.51.100.7:9", devices: []string{"eth1", "mlx5_0:1"}},
		{addr: ":0"},
		{addr: "0.0.0.0:0"},
		{addr: "[::]:0"},
		{addr: "10.9.9.9:0", err: "not the address of any network interface"},
		{addr: "127.0.0.2:0", err: "not the address of any network interface"},
		{addr: "127.0.0.1", err: "missing port"},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			b, err := bindDevices(context.Background(), tc.addr, ifs, rdma)
			if checkErr(t, err, tc.err) {
				return
			}
			if !slices.Equal(b.devices, tc.devices) || b.ipv6 != tc.ipv6 {
				t.Errorf("devices %v ipv6 %v, want %v %v", b.devices, b.ipv6, tc.devices, tc.ipv6)
			}
			if (tc.devices == nil) != (b.String() == "every device") {
				t.Errorf("String() = %q", b.String())
			}
		})
	}
}

// TestBindInterface: Options.Interface (TRTLLM_UCX_INTERFACE) binds the
// interface's first IPv4 address, or its first address without one; an
// interface the host does not have is an error naming those it has.
func TestBindInterface(t *testing.T) {
	ifs := []netIface{
		{"lo", []netip.Addr{netip.MustParseAddr("::1"), netip.MustParseAddr("127.0.0.1")}},
		{"eth0", []netip.Addr{netip.MustParseAddr("fd00::2"), netip.MustParseAddr("192.0.2.2"), netip.MustParseAddr("192.0.2.3")}},
		{"ib0", []netip.Addr{netip.MustParseAddr("fd00::7")}},
		{"down0", nil},
	}
	rdma := []string{"mlx5_0:1"}
	for _, tc := range []struct {
		iface   string
		host    string
		devices []string
		err     string
	}{
		{iface: "lo", host: "127.0.0.1", devices: []string{"lo"}},
		{iface: "eth0", host: "192.0.2.2", devices: []string{"eth0", "mlx5_0:1"}},
		{iface: "ib0", host: "fd00::7", devices: []string{"ib0", "mlx5_0:1"}},
		{iface: "down0", err: `network interface "down0" has no IP address`},
		{iface: "nope0", err: `no network interface "nope0" on this host (it has: lo, eth0, ib0, down0)`},
	} {
		t.Run(tc.iface, func(t *testing.T) {
			b, err := bindInterface(context.Background(), tc.iface, ifs, rdma)
			if checkErr(t, err, tc.err) {
				return
			}
			if b.host.String() != tc.host || !slices.Equal(b.devices, tc.devices) {
				t.Errorf("host %v devices %v, want %v %v", b.host, b.devices, tc.host, tc.devices)
			}
		})
	}
}

// checkErr fails t unless err is as expected: nil when want is "", else
// an error containing want. It reports whether an error was expected (the
// case is then done).
func checkErr(t *testing.T, err error, want string) bool {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatal(err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Fatalf("err = %v, want one containing %q", err, want)
	}
	return want != ""
}
