package link

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/transceiver/internal/control"
	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// autoOrder is AUTO's order of preference in the tests (the transceiver
// passes config.AutoPreference's).
var autoOrder = []string{"shm", "ucx", "tcp"}

// TestChooseBackend: the choice of a pair's data plane from both Hellos
// and the shm probe's answer, case by case.
func TestChooseBackend(t *testing.T) {
	all := []string{"shm", "tcp", "ucx"}
	unreachable := errors.New("another mount namespace")
	peer := func(host string, backends ...string) control.Peer {
		return control.Peer{Rank: 1, Host: host, Backends: backends, Endpoint: "10.0.0.2:5000"}
	}
	for _, tc := range []struct {
		name        string
		want        string
		mine        []string
		peer        control.Peer
		shm         shmAnswer
		backend     string
		probe       bool
		passed, err error
	}{
		{name: "configured, both have it", want: "tcp", mine: all, peer: peer("a", "tcp"), backend: "tcp"},
		{name: "configured, the peer lacks it", want: "ucx", mine: all, peer: peer("a", "tcp", "shm"), err: transport.ErrNotBuilt},
		{name: "configured shm needs no probe", want: "shm", mine: all, peer: peer("b", "shm"), backend: "shm"},
		{name: "auto, same host, probe not answered", want: "auto", mine: all, peer: peer("a", all...), probe: true},
		{name: "auto, same host, shm reached", want: "auto", mine: all, peer: peer("a", all...), shm: shmAnswer{known: true}, backend: "shm"},
		{name: "auto, same host, shm unreachable: ucx", want: "auto", mine: all, peer: peer("a", all...),
			shm: shmAnswer{known: true, err: unreachable}, backend: "ucx", passed: unreachable},
		{name: "auto, same host, shm unreachable, no ucx: tcp", want: "auto", mine: []string{"shm", "tcp"}, peer: peer("a", all...),
			shm: shmAnswer{known: true, err: unreachable}, backend: "tcp", passed: unreachable},
		{name: "auto, another host: no probe, ucx", want: "auto", mine: all, peer: peer("b", all...), backend: "ucx"},
		{name: "auto, only the peer has ucx", want: "auto", mine: []string{"tcp"}, peer: peer("b", "ucx", "tcp"), backend: "tcp"},
		{name: "auto, nothing in common", want: "auto", mine: []string{"tcp"}, peer: peer("a", "shm", "ucx"), err: errNoCommonBackend},
		{name: "auto, shm only and unreachable", want: "auto", mine: []string{"shm"}, peer: peer("a", "shm"),
			shm: shmAnswer{known: true, err: unreachable}, passed: unreachable, err: errNoCommonBackend},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := chooseBackend(tc.want, autoOrder, tc.mine, "a", tc.peer, tc.shm)
			if c.backend != tc.backend || c.probe != tc.probe || !errors.Is(c.passed, tc.passed) || (c.passed == nil) != (tc.passed == nil) {
				t.Errorf("got backend %q probe %v passed %v; want %q %v %v", c.backend, c.probe, c.passed, tc.backend, tc.probe, tc.passed)
			}
			if !errors.Is(c.err, tc.err) || (c.err == nil) != (tc.err == nil) {
				t.Errorf("error %v, want %v", c.err, tc.err)
			}
		})
	}
}

// endpointTr is a data plane that has a name and an endpoint.
type endpointTr struct{ fakeTr }

func (e *endpointTr) Endpoint() string { return e.name + "-ep" }

// TestHello: a rank's Hello names its data planes in sorted order, each
// with its own endpoint, and carries its rank, state, host and the wire's
// version.
func TestHello(t *testing.T) {
	trs := map[string]transport.Transport{}
	for _, n := range []string{"ucx", "shm", "tcp"} {
		trs[n] = &endpointTr{fakeTr{name: n}}
	}
	h := Hello(3, []byte{1, 2}, "host-a", trs)
	if !slices.Equal(h.Backends, []string{"shm", "tcp", "ucx"}) || !slices.Equal(h.Endpoints, []string{"shm-ep", "tcp-ep", "ucx-ep"}) {
		t.Errorf("backends %v at %v; want shm, tcp, ucx, each at its own endpoint", h.Backends, h.Endpoints)
	}
	if h.Version != wire.Version || h.Rank != 3 || h.Host != "host-a" || !bytes.Equal(h.State, []byte{1, 2}) {
		t.Errorf("hello %+v: want version %d, rank 3, host-a, state [1 2]", h, wire.Version)
	}
}
