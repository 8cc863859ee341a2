//go:build chaos

package main

import "github.com/kvxfer/kvxfer/transport/faultinject"

// A binary built with -tags chaos (the chaos suite's, tests/chaos) has the
// data-plane backend "faulty+tcp": tcp with the faults that the
// environment variable KVXFER_FAULTS plans (see package faultinject).
// Other binaries do not contain the package.
func init() { faultinject.Register("tcp") }
