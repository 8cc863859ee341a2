// Package transport owns the byte-moving layer of kvxfer: which data-plane
// backends exist (tcp, shm, ucx), whether each is available in this binary
// and why not.
//
// transport knows bytes, endpoints and memory regions, never requests,
// layouts or the public config (it must not import package config). It
// defines what every backend implements (Backend, Transport, Recv,
// Descriptor, Options), the errors they share, and the registry they
// register in. The backends live in sub-packages (tcp, shm, ucx), and
// transporttest is the conformance suite every backend passes.
package transport
