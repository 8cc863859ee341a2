// Package chaos is the chaos suite (issue #13): test code only.
//
// The process harness (TestChaosShort, and TestChaosLong with -chaos.long)
// builds kvxfer with -tags chaos, starts real processes on loopback — a
// context worker (TP2), two generation workers, an aggregated worker for
// the reference answers and the router, with mutual TLS between the router
// and the workers — puts a userspace TCP proxy between the router and each
// worker, drives bounded load through the router and injects faults at
// random from a seed: SIGKILL of a generation worker (then a restart),
// SIGSTOP/SIGCONT of a worker, live connections cut by the proxy, bytes
// flipped by the proxy. Every request must end bit-exact (its token ids
// equal the aggregated worker's) or with a clear error; after each run no
// block may stay pinned past the transfer deadline, every process's
// goroutines and open files (idle keep-alive connections and idle transfer
// workers left out, read from its goroutine profile) return to within a
// slack of their level after the warm-up, its HTTP connections too, and
// no process crashed, panicked or reported a data race.
//
// TestFaultyTransceiver runs engines in process over tcp data planes
// wrapped with faults (transceiver.Options.WrapDataPlane with package
// transport/faultinject, one plan per fault kind): every request completes
// bit-exact or fails with a clear error, and no block stays pinned.
//
// make chaos runs the long suite and prints the figures table (README,
// Reliability).
package chaos
