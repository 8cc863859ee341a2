// Package transport owns the byte-moving layer of kvxfer: which data-plane
// backends exist (tcp, shm, ucx), whether each is available in this binary
// and why not.
//
// transport knows bytes, endpoints and memory regions, never requests,
// layouts or the public config (it must not import package config). The
// backend interfaces and the conformance suite arrive with the transceiver;
// this file set holds the registry every backend will register in.
package transport
