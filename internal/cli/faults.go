package cli

import "github.com/kvxfer/kvxfer/transport"

// wrapFunc wraps a worker's data planes (transceiver.Options.WrapDataPlane).
type wrapFunc = func(name string, t transport.Transport) transport.Transport

// dataPlaneFaults returns the wrapper of a worker's data planes: none,
// except in a binary built with -tags chaos (chaos.go), where the
// environment may plan faults.
var dataPlaneFaults = func() (wrapFunc, error) { return nil, nil }
