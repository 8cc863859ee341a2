package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"go.uber.org/goleak"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/golden")

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func golden(t *testing.T, name string, got string) {
	t.Helper()
	path := filepath.Join("testdata", "golden", name)
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("golden file missing (run go test ./config -update): %v", err)
	}
	if diff := cmp.Diff(string(want), got); diff != "" {
		t.Errorf("%s mismatch (-want +got):\n%s", path, diff)
	}
}

// yamlFiles lists the *.yaml and *.yml files of dir.
func yamlFiles(dir string) []string {
	var out []string
	for _, pat := range []string{"*.yaml", "*.yml"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		out = append(out, m...)
	}
	sort.Strings(out)
	return out
}

func files(t *testing.T, dir string) []string {
	t.Helper()
	m := yamlFiles(filepath.Join("testdata", dir))
	if len(m) == 0 {
		t.Fatalf("no testdata in %s", dir)
	}
	return m
}

// stem is a file's name without its directory and extension.
func stem(path string) string {
	b := filepath.Base(path)
	return strings.TrimSuffix(b, filepath.Ext(b))
}

// report is what the golden files hold for a file that loaded (f non-nil):
// its effective config with the source of every value, what each backend
// resolves to, every warning and every error.
func report(t *testing.T, f *File, err error) string {
	t.Helper()
	var b bytes.Buffer
	if f != nil {
		if ferr := f.Format(&b); ferr != nil {
			t.Fatal(ferr)
		}
		for _, nt := range f.Transceivers() {
			r := nt.CT.Resolve(nil)
			fmt.Fprintf(&b, "# %s.backend: %s → %s: %s\n", nt.Path, r.Configured, r.Backend, r.Reason)
			if r.Warning != "" {
				fmt.Fprintf(&b, "warning: %s\n", r.Warning)
			}
		}
		for _, w := range f.Warnings {
			b.WriteString("warning: " + w.String() + "\n")
		}
	}
	if err != nil {
		b.WriteString("error: " + strings.ReplaceAll(err.Error(), "\n", "\nerror: ") + "\n")
	}
	return b.String()
}

// TestGoodFiles loads every valid file and compares its effective config
// (with the sources of each value) against a golden file.
func TestGoodFiles(t *testing.T) {
	for _, path := range files(t, "good") {
		t.Run(filepath.Base(path), func(t *testing.T) {
			f, err := LoadFile(path, Env{})
			if err != nil {
				t.Fatalf("LoadFile: %v", err)
			}
			golden(t, "good_"+stem(path)+".txt", report(t, f, nil))
		})
	}
}

// TestUpstreamCorpus loads every file of testdata/upstream: worker and
// cluster files written here in the shapes TensorRT-LLM's own take (its
// examples, its docs, its disaggregated integration tests; current and
// mid-2025 forms). Each loads, except those named refused_*, which must be
// refused; the report of each is compared against its golden file.
func TestUpstreamCorpus(t *testing.T) {
	paths := files(t, "upstream")
	if len(paths) < 30 {
		t.Fatalf("the corpus has %d files, want at least 30", len(paths))
	}
	env := Env{}.WithInterfaces("lo", "eth0")
	for _, path := range paths {
		t.Run(filepath.Base(path), func(t *testing.T) {
			f, err := LoadFile(path, env)
			if refused := strings.HasPrefix(stem(path), "refused_"); refused != (err != nil) {
				t.Fatalf("refused_ prefix %v, LoadFile error: %v", refused, err)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not match ErrInvalid: %v", err)
			}
			golden(t, "upstream_"+stem(path)+".txt", report(t, f, err))
		})
	}
}

// TestBadFiles checks that every bad file is refused with the golden
// message, and that every message names the file and, where there is one,
// the line.
func TestBadFiles(t *testing.T) {
	for _, path := range files(t, "bad") {
		t.Run(filepath.Base(path), func(t *testing.T) {
			_, err := LoadFile(path, Env{})
			if err == nil {
				t.Fatal("LoadFile accepted a bad file")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not match ErrInvalid: %v", err)
			}
			for _, line := range strings.Split(err.Error(), "\n") {
				if !strings.HasPrefix(line, path+":") {
					t.Errorf("message does not start with the file name: %q", line)
				}
				if strings.Contains(line, "goroutine ") || strings.Contains(line, "panic") {
					t.Errorf("message looks like a crash: %q", line)
				}
			}
			golden(t, "bad_"+stem(path)+".txt", err.Error()+"\n")
		})
	}
}

func TestBadPaths(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		path, want string
	}{
		{filepath.Join(dir, "missing.yaml"), "missing.yaml: no such file or directory"},
		{dir, ": is a directory, not a config file"},
	} {
		_, err := LoadFile(tc.path, Env{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("LoadFile(%s) = %v, want one line containing %q", tc.path, err, tc.want)
		}
	}
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, bytes.Repeat([]byte("# x\n"), MaxFileSize/4+1), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadFile(big, Env{}); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("oversized file: %v", err)
	}
}

func TestBackendCase(t *testing.T) {
	for in, want := range map[string]Backend{"ucx": BackendUCX, "Ucx": BackendUCX, "DEFAULT": BackendDefault,
		"default": BackendDefault, "tcp": BackendTCP, " shm ": BackendSHM, "auto": BackendAuto, "nixl": BackendNIXL, "MPI": BackendMPI} {
		got, err := ParseBackend(in)
		if err != nil || got != want {
			t.Errorf("ParseBackend(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	_, err := ParseBackend("rdma")
	if err == nil || !strings.Contains(err.Error(), "DEFAULT, AUTO, TCP, SHM, UCX, NIXL, MPI, MOONCAKE") {
		t.Errorf("ParseBackend(rdma) = %v; want the list of valid names", err)
	}
}

// TestResolveDefault runs every combination of the three selection
// variables (unset, "1", and a value that must not count) for DEFAULT and for
// an explicit backend.
func TestResolveDefault(t *testing.T) {
	vals := []string{"", "1", "true"} // "" = unset
	names := []string{EnvUseUCX, EnvUseNIXL, EnvUseMPI}
	builtIn := func(b Backend) error {
		if b == BackendUCX {
			return errors.New("not built")
		}
		return nil
	}
	count := 0
	for _, u := range vals {
		for _, n := range vals {
			for _, m := range vals {
				env := map[string]string{}
				for i, v := range []string{u, n, m} {
					if v != "" {
						env[names[i]] = v
					}
				}
				e := EnvFromMap(env)

				// The naive rule, written out independently: the first
				// variable set to 1 decides; one that asks for a backend
				// kvxfer does not have (NIXL) gives AUTO with a warning
				// naming it; MPI is MPI.
				want, decided := BackendAuto, ""
				switch {
				case u == "1":
					want, decided = BackendUCX, EnvUseUCX
				case n == "1":
					decided = EnvUseNIXL
				case m == "1":
					want, decided = BackendMPI, EnvUseMPI
				}
				r := ResolveBackend(BackendDefault, e, builtIn)
				count++
				if r.Backend != want {
					t.Errorf("env %v: DEFAULT → %s, want %s", env, r.Backend, want)
				}
				if r.Reason == "" {
					t.Errorf("env %v: no reason", env)
				}
				if decided != "" && !strings.Contains(r.Reason, decided+"=1") {
					t.Errorf("env %v: reason %q does not name %s", env, r.Reason, decided)
				}
				fallback := decided == EnvUseNIXL
				if fallback != (r.Warning != "") || (fallback && !strings.Contains(r.Warning, decided+"=1")) {
					t.Errorf("env %v: warning %q", env, r.Warning)
				}
				if want == BackendUCX {
					if !errors.Is(r.Err, ErrBackendUnavailable) {
						t.Errorf("env %v: UCX should be unavailable here, got %v", env, r.Err)
					}
				} else if r.Err != nil {
					t.Errorf("env %v: unexpected error %v", env, r.Err)
				}
				// Every set variable that did not decide is listed as ignored.
				if len(r.Ignored) != len(env)-btoi(decided != "") {
					t.Errorf("env %v: ignored %q", env, r.Ignored)
				}

				// An explicit backend ignores all of them.
				for _, b := range []Backend{BackendUCX, BackendTCP, BackendSHM, BackendAuto} {
					r := ResolveBackend(b, e, nil)
					if r.Backend != b || len(r.Ignored) != len(env) {
						t.Errorf("explicit %s with env %v → %s, ignored %q", b, env, r.Backend, r.Ignored)
					}
				}
			}
		}
	}
	if count != 27 {
		t.Fatalf("ran %d combinations", count)
	}
	if r := ResolveBackend(BackendUnset, Env{}, nil); !errors.Is(r.Err, ErrNoTransceiver) {
		t.Errorf("unset backend: %v", r.Err)
	}
	if r := ResolveBackend(BackendMPI, Env{}, nil); r.Err != nil || r.Backend != BackendMPI || !strings.Contains(r.Reason, "takes the whole world down") {
		t.Errorf("MPI: %+v, want MPI with the world's note in its reason", r)
	}
	notBuilt := func(Backend) error { return errors.New("not built in this binary: build with -tags mpi") }
	if r := ResolveBackend(BackendMPI, Env{}, notBuilt); !errors.Is(r.Err, ErrBackendUnavailable) || !strings.Contains(r.Err.Error(), "-tags mpi") {
		t.Errorf("MPI not built: %v", r.Err)
	}
}

// TestResolveUCXInterfaceIgnored: TRTLLM_UCX_INTERFACE is listed as
// ignored, with the backend that ignores it, wherever UCX cannot be the
// transport; under UCX and AUTO it applies.
func TestResolveUCXInterfaceIgnored(t *testing.T) {
	env := EnvFromMap(map[string]string{EnvUCXInterface: "eth0"})
	for _, tc := range []struct {
		b       Backend
		ignored bool
	}{{BackendTCP, true}, {BackendSHM, true}, {BackendMPI, true}, {BackendUCX, false}, {BackendAuto, false}, {BackendDefault, false}} {
		r := ResolveBackend(tc.b, env, nil)
		got := slices.ContainsFunc(r.Ignored, func(s string) bool {
			return strings.HasPrefix(s, EnvUCXInterface+"=eth0: ignored, backend "+string(r.Backend))
		})
		if got != tc.ignored {
			t.Errorf("backend %s: ignored %q, want TRTLLM_UCX_INTERFACE listed: %v", tc.b, r.Ignored, tc.ignored)
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestEnvSettings(t *testing.T) {
	data := []byte("cache_transceiver_config:\n  backend: TCP\n")
	tests := []struct {
		env     map[string]string
		want    func(ct *CacheTransceiver) bool
		wantErr string
	}{
		{nil, func(ct *CacheTransceiver) bool {
			return ct.TransferBufferSize == 512<<20 && ct.SendBuffers == 2 && ct.RecvBuffers == 1 && ct.ZeroCopy
		}, ""},
		{map[string]string{EnvTransferBuffer: "0B"}, func(ct *CacheTransceiver) bool { return ct.TransferBufferSize == 0 }, ""},
		{map[string]string{EnvTransferBuffer: "1GB"}, func(ct *CacheTransceiver) bool { return ct.TransferBufferSize == 1<<30 }, ""},
		{map[string]string{EnvTransferBuffer: "64KiB"}, func(ct *CacheTransceiver) bool { return ct.TransferBufferSize == 64<<10 }, ""},
		{map[string]string{EnvTransferBuffer: "lots"}, nil, "env TRTLLM_KVCACHE_TRANSFER_BUFFER_SIZE: want a size"},
		{map[string]string{EnvTransferBuffer: "99999999999GB"}, nil, "overflows"},
		{map[string]string{EnvSendConcurrency: "4"}, func(ct *CacheTransceiver) bool { return ct.SendBuffers == 4 }, ""},
		{map[string]string{EnvSendConcurrency: "0"}, nil, "TRTLLM_KVCACHE_SEND_MAX_CONCURRENCY_NUM: want an integer 1..64"},
		{map[string]string{EnvRequestConcurrent: "1"}, func(ct *CacheTransceiver) bool { return ct.RecvBuffers == 2 }, ""},
		{map[string]string{EnvRequestConcurrent: "1", EnvRecvBufferCount: "3"}, func(ct *CacheTransceiver) bool { return ct.RecvBuffers == 3 }, ""},
		{map[string]string{EnvRecvBufferCount: "3"}, func(ct *CacheTransceiver) bool { return ct.RecvBuffers == 1 }, ""},
		{map[string]string{EnvTryZeroCopy: "0"}, func(ct *CacheTransceiver) bool { return !ct.ZeroCopy }, ""},
		{map[string]string{EnvTryZeroCopy: "yes"}, nil, "want 0 or 1"},
		{map[string]string{EnvTimeOutputPath: "/tmp/t", EnvUCXInterface: "eth0", "UCX_TLS": "tcp"}, func(ct *CacheTransceiver) bool {
			return ct.TimeOutputPath == "/tmp/t" && ct.UCXInterface == "eth0" && ct.Env.Raw["UCX_TLS"] == "tcp"
		}, ""},
		{map[string]string{EnvUCXInterface: "ib7"}, nil, `env TRTLLM_UCX_INTERFACE: no network interface "ib7" on this host (it has: lo, eth0)`},
	}
	for i, tc := range tests {
		f, err := LoadBytes("w.yaml", data, EnvFromMap(tc.env).WithInterfaces("lo", "eth0"))
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%d: env %v: error %v, want %q", i, tc.env, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%d: env %v: %v", i, tc.env, err)
			continue
		}
		if ct := f.Worker.CacheTransceiver; !tc.want(ct) {
			t.Errorf("%d: env %v: unexpected %+v", i, tc.env, *ct)
		}
	}
}

// TestSources checks that config check can say where every value came from.
func TestSources(t *testing.T) {
	data := []byte("kv_cache_config:\n  tokens_per_block: 16\ncache_transceiver_config:\n  backend: DEFAULT\n")
	f, err := LoadBytes("w.yaml", data, EnvFromMap(map[string]string{EnvSendConcurrency: "3"}))
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		"kv_cache_config.tokens_per_block":                "file w.yaml:2:21",
		"cache_transceiver_config.backend":                "file w.yaml:4:12",
		"cache_transceiver_config.send_buffers":           "env " + EnvSendConcurrency,
		"cache_transceiver_config.kv_transfer_timeout_ms": "default",
		"tensor_parallel_size":                            "default",
	} {
		if got := f.Source(path).String(); got != want {
			t.Errorf("Source(%s) = %q, want %q", path, got, want)
		}
	}
}

// TestRoundTrip: the printed effective config loads back to the same value.
func TestRoundTrip(t *testing.T) {
	env := EnvFromMap(map[string]string{EnvTransferBuffer: "256MB", EnvRequestConcurrent: "1"})
	var paths []string
	for _, p := range append(files(t, "good"), files(t, "upstream")...) {
		if !strings.HasPrefix(stem(p), "refused_") {
			paths = append(paths, p)
		}
	}
	for _, path := range paths {
		t.Run(filepath.Base(path), func(t *testing.T) {
			f1, err := LoadFile(path, env)
			if err != nil {
				t.Fatal(err)
			}
			var b bytes.Buffer
			if err := f1.Format(&b); err != nil {
				t.Fatal(err)
			}
			f2, err := LoadBytes("printed.yaml", b.Bytes(), env)
			if err != nil {
				t.Fatalf("printed config does not load: %v\n%s", err, b.String())
			}
			opts := cmp.Options{cmpopts.IgnoreFields(File{}, "Path", "Sources", "Warnings"), cmpopts.IgnoreUnexported(Env{}), cmpopts.EquateEmpty()}
			if diff := cmp.Diff(f1, f2, opts); diff != "" {
				t.Errorf("round trip changed the config (-first +second):\n%s", diff)
			}
		})
	}
}

// TestReportsEveryProblem: one file with many problems reports all of them.
func TestReportsEveryProblem(t *testing.T) {
	_, err := LoadFile(filepath.Join("testdata", "bad", "many.yaml"), Env{})
	var ps Problems
	if !errors.As(err, &ps) {
		t.Fatalf("want Problems, got %T %v", err, err)
	}
	if len(ps) < 6 {
		t.Errorf("want at least 6 problems, got %d:\n%v", len(ps), err)
	}
	for _, p := range ps {
		if p.Line == 0 || p.Path == "" {
			t.Errorf("problem without a line or a path: %+v", p)
		}
	}
}

func TestValidateHandBuilt(t *testing.T) {
	ct := &CacheTransceiver{Backend: "NIXL", MaxTokensInBuffer: 33, KVTransferTimeoutMs: -1}
	err := ct.Validate(32)
	if err == nil {
		t.Fatal("Validate accepted a bad config")
	}
	for _, want := range []string{"backend: NIXL is not available", "33 is not a multiple of tokens_per_block (32)", "kv_transfer_timeout_ms: -1 is out of range"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}
	ok := &CacheTransceiver{Backend: BackendTCP, MaxTokensInBuffer: 64}
	if err := ok.Validate(32); err != nil {
		t.Errorf("Validate: %v", err)
	}
	if got := ok.Timeout().Seconds(); got != 60 {
		t.Errorf("default timeout %vs, want 60s", got)
	}
}

func TestSuggest(t *testing.T) {
	known := []string{"cache_transceiver_config", "kv_cache_config", "tensor_parallel_size"}
	for in, want := range map[string]string{
		"cache_transciever_config": "cache_transceiver_config",
		"kv_cach_config":           "kv_cache_config",
		"tensor_paralel_size":      "tensor_parallel_size",
		"frobnicate":               "",
	} {
		if got := suggest(in, known); got != want {
			t.Errorf("suggest(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzLoad: the loader never panics, and its errors always name the file.
func FuzzLoad(f *testing.F) {
	for _, dir := range []string{"good", "bad", "upstream"} {
		for _, p := range yamlFiles(filepath.Join("testdata", dir)) {
			if b, err := os.ReadFile(p); err == nil {
				f.Add(b)
			}
		}
	}
	f.Add([]byte("a: &a [*a, *a]\ncache_transceiver_config: *a\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := LoadBytes("fuzz.yaml", data, Env{})
		if err != nil {
			for _, line := range strings.Split(err.Error(), "\n") {
				if !strings.HasPrefix(line, "fuzz.yaml") {
					t.Fatalf("error line without the file name: %q", line)
				}
			}
		}
		if err == nil {
			var b bytes.Buffer
			if ferr := file.Format(&b); ferr != nil {
				t.Fatalf("Format of a valid file: %v", ferr)
			}
		}
	})
}
