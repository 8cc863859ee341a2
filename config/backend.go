package config

import (
	"fmt"
	"strings"
)

// Backend names a KV-cache transfer backend as written in
// cache_transceiver_config.backend. Values are always upper case once
// parsed; the empty Backend means "not configured".
type Backend string

// Backends accepted in cache_transceiver_config.backend. DEFAULT, UCX, NIXL,
// MPI and MOONCAKE are TensorRT-LLM's; TCP, SHM and AUTO are kvxfer's own.
// NIXL and MOONCAKE are names kvxfer knows and refuses, saying why. MPI
// (deprecated in TensorRT-LLM) runs only between the ranks of one MPI world
// (kvxfer up launches every worker under one mpirun for it): MPIWorldNote.
const (
	BackendUnset    Backend = ""
	BackendDefault  Backend = "DEFAULT"
	BackendUCX      Backend = "UCX"
	BackendNIXL     Backend = "NIXL"
	BackendMPI      Backend = "MPI"
	BackendMooncake Backend = "MOONCAKE"
	BackendTCP      Backend = "TCP"
	BackendSHM      Backend = "SHM"
	// BackendAuto picks, per peer, the fastest backend that works between
	// the two ranks, in the order of AutoPreference (AutoRule). It is what
	// DEFAULT resolves to when no environment variable decides.
	BackendAuto Backend = "AUTO"
)

// AutoPreference is the order in which AUTO picks a data plane for each
// peer, fastest first: SHM when the peer is on the same host and its memory
// can be reached, else the first of the others that both ranks have open.
// It is the one list of that order; the transceiver applies it.
var AutoPreference = []Backend{BackendSHM, BackendUCX, BackendTCP}

// AutoRule says in one phrase how AUTO chooses (AutoPreference), for
// messages and listings.
const AutoRule = "SHM on the same host, else UCX when built in, else TCP"

// MPIWorldNote says what choosing MPI implies, for the log line that says
// why it was chosen and for listings.
const MPIWorldNote = "MPI moves data only between the ranks of one MPI world started by one mpirun " +
	"(kvxfer up launches every worker that way; kvxfer serve-mpi runs one), and a rank that dies takes the whole world down"

// Lower returns b in lower case, as kvxfer's flags, its bench reports and
// the transport registry spell backend names ("tcp", "auto").
func (b Backend) Lower() string { return strings.ToLower(string(b)) }

// ValidBackends lists every name ParseBackend accepts, in the order they
// are shown to users.
var ValidBackends = []Backend{BackendDefault, BackendAuto, BackendTCP, BackendSHM, BackendUCX, BackendNIXL, BackendMPI, BackendMooncake}

// ParseBackend parses a backend name in any case ("ucx", "Ucx") and returns
// it in upper case. Mid-2025 TRT-LLM configs used lower case, so both are
// accepted.
func ParseBackend(s string) (Backend, error) {
	b := Backend(strings.ToUpper(strings.TrimSpace(s)))
	for _, v := range ValidBackends {
		if b == v {
			return b, nil
		}
	}
	return BackendUnset, fmt.Errorf("unknown backend %q (valid: %s)", s, backendList())
}

func backendList() string {
	names := make([]string, len(ValidBackends))
	for i, b := range ValidBackends {
		names[i] = string(b)
	}
	return strings.Join(names, ", ")
}

// unsupported explains why a backend that TRT-LLM accepts cannot run in
// kvxfer, or returns "" when kvxfer implements it.
func (b Backend) unsupported() string {
	switch b {
	case BackendNIXL:
		return "NIXL is not available in kvxfer: no Go binding exists and no package registry reachable here ships NIXL; use UCX (the library NIXL is built on), TCP, SHM or AUTO"
	case BackendMooncake:
		return "MOONCAKE (TensorRT-LLM's Mooncake Transfer Engine backend) is not available in kvxfer: no Go binding exists and no package registry reachable here ships it; use UCX, TCP, SHM or AUTO"
	}
	return ""
}
