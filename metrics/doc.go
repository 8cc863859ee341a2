// Package metrics defines kvxfer's Prometheus metrics: names with the
// kvxfer_ prefix and base units (bytes, seconds), registered on a registry
// the caller passes in — never the global one, so that tests and several
// workers in one process do not collide.
//
// It defines every collector of a worker (Set) and of a router (Router),
// the registry they live on (NewRegistry: the Go runtime's and the
// process's collectors besides) and its HTTP handler (Handler).
//
// It knows no kvxfer package: callers feed it (serve adapts the
// transceiver's Observer and the engine's timings to it).
package metrics
