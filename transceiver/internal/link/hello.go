package link

import (
	"maps"
	"slices"

	"github.com/kvxfer/kvxfer/transceiver/internal/wire"
	"github.com/kvxfer/kvxfer/transport"
)

// Hello is what a rank tells of itself when a control connection opens,
// in either direction, and what the peer's chooseBackend reads: its rank,
// its instance's state (encoded), its host, and its data planes' names,
// sorted, each with its endpoint.
func Hello(rank uint32, state []byte, host string, trs map[string]transport.Transport) wire.Hello {
	names := slices.Sorted(maps.Keys(trs))
	eps := make([]string, len(names))
	for i, n := range names {
		eps[i] = trs[n].Endpoint()
	}
	return wire.Hello{Version: wire.Version, Rank: rank, State: state, Host: host, Backends: names, Endpoints: eps}
}
