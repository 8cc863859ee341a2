package config

import (
	"fmt"
	"math"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Environment variables honoured by kvxfer, with TensorRT-LLM's meaning.
const (
	EnvUseUCX            = "TRTLLM_USE_UCX_KVCACHE"
	EnvUseNIXL           = "TRTLLM_USE_NIXL_KVCACHE"
	EnvUseMPI            = "TRTLLM_USE_MPI_KVCACHE"
	EnvTransferBuffer    = "TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE"
	EnvSendConcurrency   = "TRTLLM_KVCACHE_SEND_MAX_CONCURRENCY_NUM"
	EnvRequestConcurrent = "TRTLLM_REQUEST_KV_CACHE_CONCURRENT"
	EnvRecvBufferCount   = "TRTLLM_KVCACHE_RECV_BUFFER_COUNT"
	EnvTryZeroCopy       = "TRTLLM_TRY_ZCOPY_FOR_KVCACHE_TRANSFER"
	EnvTimeOutputPath    = "TRTLLM_KVCACHE_TIME_OUTPUT_PATH"
	EnvUCXInterface      = "TRTLLM_UCX_INTERFACE"
	// EnvAllowedPeerHosts and EnvClusterSecret are in security.go.
)

// maxBufferCount bounds the buffer counts set by environment variables.
const maxBufferCount = 64

// Env is a snapshot of the environment variables that matter to the KV-cache
// transfer path, read once (LoadEnv) and passed around by value. Flags
// count only when their value is exactly "1", as in TRT-LLM.
type Env struct {
	// Raw holds every honoured TRTLLM_* variable that was set (and those
	// of the transfer path that kvxfer reads only to say they have no
	// effect), and every UCX_* variable, by name. It never holds a
	// secret: it is printed in reports.
	Raw map[string]string
	// lookup is the lookup the snapshot was taken with: the cluster secret
	// is read through it when needed (Security.LoadSecret), never copied
	// into Raw. Nil: no variable beyond Raw is set.
	lookup func(string) (string, bool)
	// interfaces lists the network interfaces of this host, for
	// TRTLLM_UCX_INTERFACE; nil means net.Interfaces.
	interfaces func() ([]string, error)
}

// WithInterfaces returns e with the network interfaces of the host given,
// instead of read from the system (tests; a check made for another host).
func (e Env) WithInterfaces(names ...string) Env {
	names = slices.Clone(names)
	e.interfaces = func() ([]string, error) { return names, nil }
	return e
}

// hostInterfaces lists the names of the network interfaces of this host.
func (e Env) hostInterfaces() ([]string, error) {
	if e.interfaces != nil {
		return e.interfaces()
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	names := make([]string, len(ifs))
	for i, fi := range ifs {
		names[i] = fi.Name
	}
	return names, nil
}

// LoadEnv reads the environment through lookup (os.LookupEnv in programs,
// a map in tests) and returns the snapshot. UCX_* variables are found by
// scanning environ, which may be nil.
func LoadEnv(lookup func(string) (string, bool), environ []string) Env {
	e := Env{Raw: map[string]string{}, lookup: lookup}
	for _, k := range []string{EnvUseUCX, EnvUseNIXL, EnvUseMPI, EnvTransferBuffer, EnvSendConcurrency,
		EnvRequestConcurrent, EnvRecvBufferCount, EnvTryZeroCopy, EnvTimeOutputPath, EnvUCXInterface, EnvAllowedPeerHosts} {
		if v, ok := lookup(k); ok {
			e.Raw[k] = v
		}
	}
	for k := range envNotApplied {
		if v, ok := lookup(k); ok {
			e.Raw[k] = v
		}
	}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok && strings.HasPrefix(k, "UCX_") {
			e.Raw[k] = v
		}
	}
	return e
}

// EnvFromMap is a convenience for tests and callers that already hold the
// variables in a map.
func EnvFromMap(m map[string]string) Env {
	environ := make([]string, 0, len(m))
	for k, v := range m {
		environ = append(environ, k+"="+v)
	}
	return LoadEnv(func(k string) (string, bool) { v, ok := m[k]; return v, ok }, environ)
}

// lookupVar reads a variable that is not part of the snapshot (the cluster
// secret, or the variable security.secret_env names).
func (e Env) lookupVar(name string) (string, bool) {
	if e.lookup == nil {
		return "", false
	}
	return e.lookup(name)
}

// Flag reports whether the variable is set to exactly "1".
func (e Env) Flag(name string) bool { return e.Raw[name] == "1" }

// Names returns the set variables in sorted order.
func (e Env) Names() []string {
	names := make([]string, 0, len(e.Raw))
	for k := range e.Raw {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

// ParseByteSize parses sizes as TRT-LLM's TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE
// does: a non-negative integer with an optional unit B, KB, MB or GB (binary
// multiples; KiB, MiB and GiB are accepted too). A bare number is bytes.
func ParseByteSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"KB", 1 << 10}, {"MB", 1 << 20}, {"GB", 1 << 30}, {"B", 1}} {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("want a size such as 512MB, 1GB or 0B, got %q", s)
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("size %q overflows", s)
	}
	return n * mult, nil
}

// applyEnv fills ct's environment-derived fields and records their sources.
// Problems with a variable's value are reported on the variable.
func applyEnv(ct *CacheTransceiver, env Env, c *collector, src map[string]Source, prefix string) {
	envProblem := c.envErr
	set := func(field, name string) { src[prefix+field] = Source{Kind: SourceEnv, Env: name} }

	ct.TransferBufferSize = DefaultTransferBufferSize
	if v, ok := env.Raw[EnvTransferBuffer]; ok {
		n, err := ParseByteSize(v)
		if err != nil {
			envProblem(EnvTransferBuffer, "%v", err)
		} else {
			ct.TransferBufferSize = n
			set("transfer_buffer_size", EnvTransferBuffer)
		}
	}
	ct.SendBuffers = DefaultSendBuffers
	if v, ok := env.Raw[EnvSendConcurrency]; ok {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 || n > maxBufferCount {
			envProblem(EnvSendConcurrency, "want an integer 1..%d, got %q", maxBufferCount, v)
		} else {
			ct.SendBuffers = n
			set("send_buffers", EnvSendConcurrency)
		}
	}
	ct.RecvBuffers = 1
	if env.Flag(EnvRequestConcurrent) {
		ct.RecvBuffers = DefaultConcurrentRecv
		set("recv_buffers", EnvRequestConcurrent)
		if v, ok := env.Raw[EnvRecvBufferCount]; ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil || n < 1 || n > maxBufferCount {
				envProblem(EnvRecvBufferCount, "want an integer 1..%d, got %q", maxBufferCount, v)
			} else {
				ct.RecvBuffers = n
				set("recv_buffers", EnvRecvBufferCount)
			}
		}
	}
	ct.ZeroCopy = true
	if v, ok := env.Raw[EnvTryZeroCopy]; ok {
		switch strings.TrimSpace(v) {
		case "1":
			set("zero_copy", EnvTryZeroCopy)
		case "0":
			ct.ZeroCopy = false
			set("zero_copy", EnvTryZeroCopy)
		default:
			envProblem(EnvTryZeroCopy, "want 0 or 1, got %q", v)
		}
	}
	if v, ok := env.Raw[EnvTimeOutputPath]; ok && v != "" {
		ct.TimeOutputPath = v
		set("time_output_path", EnvTimeOutputPath)
	}
	if v, ok := env.Raw[EnvUCXInterface]; ok && v != "" {
		if err := checkInterface(env, v); err != nil {
			envProblem(EnvUCXInterface, "%v", err)
		} else {
			ct.UCXInterface = v
			set("ucx_interface", EnvUCXInterface)
		}
	}
	ct.Env = env
}

// checkInterface reports an error naming the interfaces of this host when
// name is not one of them.
func checkInterface(env Env, name string) error {
	names, err := env.hostInterfaces()
	if err != nil {
		return fmt.Errorf("cannot list the network interfaces to check %q: %v", name, err)
	}
	if slices.Contains(names, name) {
		return nil
	}
	return fmt.Errorf("no network interface %q on this host (it has: %s)", name, strings.Join(names, ", "))
}

// envNotes warns about the variables of the transfer path that are set
// but have no effect in kvxfer: those it does not apply yet, those it
// reads only to say so, and those whose value TensorRT-LLM would ignore
// too (a flag not 1, a count its flag does not turn on). Once per file.
func envNotes(env Env, c *collector) {
	concurrent, set := env.Raw[EnvRequestConcurrent]
	if set && concurrent != "1" && concurrent != "0" && concurrent != "" {
		c.envWarn(KindNotApplied, EnvRequestConcurrent, "%s accepted, no effect: only the value 1 turns it on (as in TensorRT-LLM)", concurrent)
	}
	if v, ok := env.Raw[EnvRecvBufferCount]; ok && !env.Flag(EnvRequestConcurrent) {
		c.envWarn(KindNotApplied, EnvRecvBufferCount, "%s accepted, no effect: the count of concurrent receives counts only with %s=1 (as in TensorRT-LLM)",
			v, EnvRequestConcurrent)
	}
	for _, name := range env.Names() {
		if why, ok := notAppliedYet[name]; ok && env.Raw[name] != "" {
			c.envWarn(KindNotApplied, name, "%s accepted, not applied yet: %s", env.Raw[name], why)
		}
		if why, ok := envNotApplied[name]; ok {
			c.envWarn(KindNotApplied, name, "%s accepted, %s", env.Raw[name], why)
		}
	}
}
