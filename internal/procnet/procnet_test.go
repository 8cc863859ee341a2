package procnet

import (
	"net"
	"net/netip"
	"os"
	"testing"
)

func TestParseAddr(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
		err  bool
	}{
		{"0100007F:1F41", "127.0.0.1:8001", false},
		{"00000000:0050", "0.0.0.0:80", false},
		{"0202000A:0016", "10.0.2.2:22", false},
		{"00000000000000000000000001000000:1F90", "[::1]:8080", false},
		{"00000000000000000000000000000000:0016", "[::]:22", false},
		{"0000000000000000FFFF00000100007F:0050", "[::ffff:127.0.0.1]:80", false},
		{"0100007F", "", true},
		{"0100007:0050", "", true},
		{"0100007F:GGGG", "", true},
	} {
		got, err := ParseAddr(tc.in)
		if (err != nil) != tc.err {
			t.Errorf("ParseAddr(%q): err %v, want error %v", tc.in, err, tc.err)
			continue
		}
		if err == nil && got != netip.MustParseAddrPort(tc.want) {
			t.Errorf("ParseAddr(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestListening(t *testing.T) {
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skip("needs Linux's /proc/net/tcp")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String()) // not a listener: not listed
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ls, err := Listening(0)
	if err != nil {
		t.Fatal(err)
	}
	want := netip.MustParseAddrPort(ln.Addr().String())
	found := 0
	for _, l := range ls {
		if l.Addr == want {
			found++
		}
		if l.Addr.Port() == netip.MustParseAddrPort(c.LocalAddr().String()).Port() {
			t.Errorf("the client socket %v is listed as a listener", l.Addr)
		}
	}
	if found != 1 {
		t.Errorf("Listening(0) = %v, want %v once", ls, want)
	}
	if ls2, err := Listening(os.Getpid()); err != nil || len(ls2) != len(ls) {
		t.Errorf("Listening(pid) = %v, %v; Listening(0) = %v", ls2, err, ls)
	}
}
