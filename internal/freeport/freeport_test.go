package freeport

import (
	"net"
	"strconv"
	"testing"
)

func TestPortsDistinctBelowEphemeralAndBindable(t *testing.T) {
	lo := ephemeralLow()
	ps, err := Ports(50)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ps {
		if p < lowest || p >= lo {
			t.Errorf("port %d outside [%d, %d)", p, lowest, lo)
		}
		if seen[p] {
			t.Errorf("port %d handed out twice", p)
		}
		seen[p] = true
	}
	p, err := Port()
	if err != nil {
		t.Fatal(err)
	}
	if seen[p] {
		t.Errorf("Port repeated %d", p)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	if err != nil {
		t.Fatalf("the port handed out does not bind: %v", err)
	}
	ln.Close()
}
