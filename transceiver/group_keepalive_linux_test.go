package transceiver

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"
)

// TestGroupKeepAlive: both ends of a coordinated group's connection probe
// it when idle (groupKeepAlive), so that a process whose host is gone is
// found out in seconds.
func TestGroupKeepAlive(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g, err := NewCoordinatedGroup(CoordinatedConfig{Processes: 2, Coordinator: ln.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	dialled, err := g.dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer dialled.Close()
	accepted, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer accepted.Close()
	keepAlive(accepted)
	for name, c := range map[string]net.Conn{"dialled": dialled, "accepted": accepted} {
		raw, err := c.(*net.TCPConn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var on, idle, intvl, cnt int
		var serr error
		raw.Control(func(fd uintptr) {
			get := func(level, opt int) int {
				v, err := syscall.GetsockoptInt(int(fd), level, opt)
				if err != nil && serr == nil {
					serr = err
				}
				return v
			}
			on = get(syscall.SOL_SOCKET, syscall.SO_KEEPALIVE)
			idle = get(syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)
			intvl = get(syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL)
			cnt = get(syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT)
		})
		if serr != nil {
			t.Fatal(serr)
		}
		if on == 0 || idle != 2 || intvl != 1 || cnt != 3 {
			t.Errorf("%s: keepalive %d idle %ds interval %ds count %d, want on, 2, 1, 3", name, on, idle, intvl, cnt)
		}
	}
}
