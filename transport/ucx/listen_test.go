//go:build ucx && cgo

package ucx

import (
	"context"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/procnet"
	"github.com/kvxfer/kvxfer/transport"
)

// TestListensOnlyOnTheListenHost opens a transport with a loopback listen
// address and checks, in the kernel's socket tables, that every TCP
// listener it added is on 127.0.0.1: UCX's tcp transport listens on every
// device it uses (issue #10 found it on the machine's other interfaces).
func TestListensOnlyOnTheListenHost(t *testing.T) {
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skip("needs Linux's /proc/net/tcp")
	}
	if _, set := envNetDevices(); set {
		t.Skip("UCX_NET_DEVICES is set: it chooses the devices")
	}
	before := listenerSet(t)
	tr, err := Open(context.Background(), transport.Options{ListenAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if got := tr.ListenAddrs(); len(got) != 1 || got[0] != "127.0.0.1 (lo)" {
		t.Errorf("ListenAddrs() = %q, want [\"127.0.0.1 (lo)\"]", got)
	}
	ls, err := procnet.Listening(0)
	if err != nil {
		t.Fatal(err)
	}
	want := netip.MustParseAddr("127.0.0.1")
	added := 0
	for _, l := range ls {
		if before[l.Inode] {
			continue
		}
		added++
		if l.Addr.Addr() != want {
			t.Errorf("UCX listens on %v, want only %v", l.Addr, want)
		}
	}
	if added == 0 {
		t.Log("UCX added no TCP listener (no tcp transport?)")
	}
}

func listenerSet(t *testing.T) map[uint64]bool {
	ls, err := procnet.Listening(0)
	if err != nil {
		t.Fatal(err)
	}
	m := map[uint64]bool{}
	for _, l := range ls {
		m[l.Inode] = true
	}
	return m
}

// TestOpenInterface opens the backend on this machine's loopback interface
// by name, as TRTLLM_UCX_INTERFACE=lo does, and on an interface that does
// not exist.
func TestOpenInterface(t *testing.T) {
	if _, set := envNetDevices(); set {
		t.Skip("UCX_NET_DEVICES is set: it chooses the devices")
	}
	if _, err := net.InterfaceByName("lo"); err != nil {
		t.Skip("no interface lo:", err)
	}
	// The listen address is ignored for the interface's.
	tr, err := Open(context.Background(), transport.Options{ListenAddr: "0.0.0.0:0", Interface: "lo"})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if got := tr.ListenAddrs(); len(got) != 1 || got[0] != "127.0.0.1 (lo)" {
		t.Errorf("ListenAddrs() = %q, want [\"127.0.0.1 (lo)\"]", got)
	}
	_, err = Open(context.Background(), transport.Options{Interface: "kvxfer-nope0"})
	if err == nil || !strings.Contains(err.Error(), `no network interface "kvxfer-nope0" on this host (it has: `) ||
		!strings.Contains(err.Error(), "lo") {
		t.Errorf("Open on a missing interface: %v", err)
	}
}
