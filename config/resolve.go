package config

import (
	"errors"
	"fmt"
)

// ErrNoTransceiver is returned (in Resolution.Err) when a worker has no
// cache_transceiver_config.backend: it cannot take part in disaggregated
// serving.
var ErrNoTransceiver = errors.New("config: no cache transceiver configured (cache_transceiver_config.backend is unset); disaggregated requests are refused; set backend: DEFAULT to enable one")

// ErrBackendUnavailable is wrapped by Resolution.Err when the chosen backend
// cannot run in this binary.
var ErrBackendUnavailable = errors.New("config: backend not available")

// Resolution is the outcome of resolving a configured backend.
type Resolution struct {
	// Configured is the backend as written in the config.
	Configured Backend
	// Backend is the choice: the configured backend, or what DEFAULT
	// resolved to (UCX, NIXL, MPI or AUTO).
	Backend Backend
	// Reason says, in one sentence, why Backend was chosen. Log it.
	Reason string
	// Ignored lists environment variables that were set but had no effect,
	// each with the reason ("TRTLLM_USE_UCX_KVCACHE=1: ignored, explicit
	// backend TCP").
	Ignored []string
	// Warning, when not empty, says why DEFAULT did not become what the
	// environment asked for (NIXL, which kvxfer does not have).
	// Log it as a warning; config check prints it as one.
	Warning string
	// Err is non-nil when Backend cannot be used by this binary; it wraps
	// ErrBackendUnavailable or is ErrNoTransceiver.
	Err error
}

// ResolveBackend resolves a configured backend against the environment and
// the backends built into this binary, following TRT-LLM's precedence:
// an explicit UCX, NIXL, MPI (or kvxfer's TCP, SHM, AUTO) ignores the
// environment; DEFAULT takes TRTLLM_USE_UCX_KVCACHE=1, else
// TRTLLM_USE_NIXL_KVCACHE=1, else TRTLLM_USE_MPI_KVCACHE=1 (deprecated),
// else kvxfer's built-in default, AUTO. A flag counts only when its value is
// exactly "1".
//
// DEFAULT means "pick for me": when the variable that decides asks for a
// backend kvxfer does not have (NIXL), it resolves to AUTO, with
// Resolution.Warning naming the variable and why. An explicit NIXL stays an
// error. MPI (explicit, or DEFAULT with TRTLLM_USE_MPI_KVCACHE=1) is
// kvxfer's MPI backend; its Reason ends with MPIWorldNote.
//
// available reports whether a backend can run in this binary (nil) or why
// not; it is called once, for the final choice. ResolveBackend is pure.
func ResolveBackend(configured Backend, env Env, available func(Backend) error) Resolution {
	r := Resolution{Configured: configured, Backend: configured}
	flags := []struct {
		name string
		b    Backend
	}{{EnvUseUCX, BackendUCX}, {EnvUseNIXL, BackendNIXL}, {EnvUseMPI, BackendMPI}}

	switch configured {
	case BackendUnset:
		r.Reason = "cache_transceiver_config.backend is not set"
		r.Err = ErrNoTransceiver
		return r
	case BackendDefault:
		decided := ""
		for _, f := range flags {
			v, set := env.Raw[f.name]
			switch {
			case !set:
			case v != "1":
				r.Ignored = append(r.Ignored, fmt.Sprintf("%s=%s: ignored, only the value 1 counts", f.name, v))
			case decided != "":
				r.Ignored = append(r.Ignored, fmt.Sprintf("%s=1: ignored, %s=1 takes precedence", f.name, decided))
			default:
				decided = f.name
				r.Backend = f.b
				r.Reason = fmt.Sprintf("backend DEFAULT resolved to %s because %s=1", f.b, f.name)
				if f.b.unsupported() != "" {
					r.Backend = BackendAuto
					r.Reason = fmt.Sprintf("backend DEFAULT resolved to AUTO: %s=1 asks for %s, which kvxfer does not have (AUTO picks per peer: %s)",
						f.name, f.b, AutoRule)
					r.Warning = fmt.Sprintf("%s=1 asks DEFAULT for %s, which kvxfer does not have; using AUTO instead "+
						"(unset the variable, or set cache_transceiver_config.backend to UCX, TCP, SHM or AUTO)", f.name, f.b)
				}
			}
		}
		if decided == "" {
			r.Backend = BackendAuto
			r.Reason = "backend DEFAULT resolved to AUTO, kvxfer's built-in default, because no TRTLLM_USE_*_KVCACHE=1 is set " +
				"(AUTO picks per peer: " + AutoRule + "; TRT-LLM's own built-in default has changed between releases)"
		}
	default:
		r.Reason = fmt.Sprintf("backend %s set explicitly", configured)
		for _, f := range flags {
			if v, set := env.Raw[f.name]; set {
				r.Ignored = append(r.Ignored, fmt.Sprintf("%s=%s: ignored, backend %s is set explicitly", f.name, v, configured))
			}
		}
	}
	if r.Backend == BackendMPI {
		r.Reason += "; " + MPIWorldNote
	}
	if v := env.Raw[EnvUCXInterface]; v != "" && r.Backend != BackendUCX && r.Backend != BackendAuto {
		r.Ignored = append(r.Ignored, fmt.Sprintf("%s=%s: ignored, backend %s does not use it (it names UCX's interface: backend UCX, or AUTO when it picks UCX)",
			EnvUCXInterface, v, r.Backend))
	}
	if why := r.Backend.unsupported(); why != "" {
		r.Err = fmt.Errorf("%w: %s", ErrBackendUnavailable, why)
	} else if available != nil {
		if err := available(r.Backend); err != nil {
			r.Err = fmt.Errorf("%w: %s: %v", ErrBackendUnavailable, r.Backend, err)
		}
	}
	return r
}
