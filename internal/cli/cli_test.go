package cli

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/kvxfer/kvxfer/transport"

	"go.uber.org/goleak"
)

// The test binary doubles as the kvxfer binary for the workers that
// launch.Start starts: with KVXFER_CLI_CHILD=1 it runs the command line.
func TestMain(m *testing.M) {
	if sock := os.Getenv("KVXFER_ADMIN_PROBE"); sock != "" {
		// A client of an admin socket, run as another user by
		// TestHostileAdminListener.
		fmt.Println(adminProbe(sock))
		os.Exit(0)
	}
	if os.Getenv("KVXFER_CLI_CHILD") == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	goleak.VerifyTestMain(m)
}

func runWith(t *testing.T, vars map[string]string, args ...string) (int, string, string) {
	t.Helper()
	var environ []string
	for k, v := range vars {
		environ = append(environ, k+"="+v)
	}
	e := env{lookup: func(k string) (string, bool) { v, ok := vars[k]; return v, ok }, environ: environ}
	var out, errw bytes.Buffer
	code := run(context.Background(), args, &out, &errw, e)
	return code, out.String(), errw.String()
}

func example(name string) string { return filepath.Join("..", "..", "examples", name) }

func TestConfigCheckExamples(t *testing.T) {
	code, out, errw := runWith(t, nil, "config", "check", example("worker.yaml"), example("disagg.yaml"))
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errw)
	}
	for _, want := range []string{
		"worker file, valid", "cluster file, valid",
		"backend: UCX # file ../../examples/worker.yaml:3:12",
		"kv_transfer_timeout_ms: 60000 # default",
		"DEFAULT → AUTO",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if !strings.Contains(errw, "disable_overlap_scheduler: known TensorRT-LLM key, not used by kvxfer") {
		t.Errorf("no ignored-key warning:\n%s", errw)
	}
}

// The acceptance check: DEFAULT with TRTLLM_USE_UCX_KVCACHE=1 shows
// UCX and the reason; an explicit backend shows the variable as ignored.
func TestConfigCheckEnvResolution(t *testing.T) {
	dir := t.TempDir()
	def := filepath.Join(dir, "default.yaml")
	explicit := filepath.Join(dir, "explicit.yaml")
	os.WriteFile(def, []byte("cache_transceiver_config:\n  backend: DEFAULT\n"), 0o644)
	os.WriteFile(explicit, []byte("cache_transceiver_config:\n  backend: TCP\n"), 0o644)
	vars := map[string]string{"TRTLLM_USE_UCX_KVCACHE": "1"}

	_, out, _ := runWith(t, vars, "config", "check", def)
	if !strings.Contains(out, "DEFAULT → UCX: backend DEFAULT resolved to UCX because TRTLLM_USE_UCX_KVCACHE=1") {
		t.Errorf("DEFAULT with UCX env:\n%s", out)
	}
	_, out, _ = runWith(t, vars, "config", "check", explicit)
	if !strings.Contains(out, "TRTLLM_USE_UCX_KVCACHE=1: ignored, backend TCP is set explicitly") {
		t.Errorf("explicit backend with UCX env:\n%s", out)
	}
}

func TestConfigCheckFailures(t *testing.T) {
	dir := t.TempDir()
	nixl := filepath.Join(dir, "nixl.yaml")
	os.WriteFile(nixl, []byte("cache_transceiver_config:\n  backend: NIXL\n"), 0o644)
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("cache_transceiver_config:\n  max_tokens_in_buffer: many\n"), 0o644)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{nixl}, "nixl.yaml:2:12: cache_transceiver_config.backend: NIXL is not available in kvxfer"},
		{[]string{bad}, "bad.yaml:2:25: cache_transceiver_config.max_tokens_in_buffer: want an integer, got the string \"many\""},
		{[]string{filepath.Join(dir, "nope.yaml")}, "nope.yaml: no such file or directory"},
		{[]string{dir}, "bad.yaml:2:25: cache_transceiver_config.max_tokens_in_buffer"}, // a directory: each file under it
		{[]string{example("worker.yaml"), nixl}, "NIXL is not available"},               // one bad file fails the run
	} {
		code, _, errw := runWith(t, nil, append([]string{"config", "check"}, tc.args...)...)
		if code != 1 || !strings.Contains(errw, tc.want) {
			t.Errorf("config check %v: exit %d, stderr:\n%s\nwant exit 1 and %q", tc.args, code, errw, tc.want)
		}
		if strings.Contains(errw, "goroutine") || strings.Contains(errw, "Usage:") {
			t.Errorf("config check %v printed a trace or usage:\n%s", tc.args, errw)
		}
	}
}

func TestVersionAndBackends(t *testing.T) {
	code, out, _ := runWith(t, nil, "version")
	if code != 0 || !strings.Contains(out, "go:") || !strings.Contains(out, "revision:") || !strings.Contains(out, "backends:") {
		t.Errorf("version: exit %d\n%s", code, out)
	}
	code, out, _ = runWith(t, nil, "version", "--json")
	if code != 0 || !strings.Contains(out, `"go_version"`) || !strings.Contains(out, `"backends"`) {
		t.Errorf("version --json: exit %d\n%s", code, out)
	}
	code, out, _ = runWith(t, nil, "backends")
	if code != 0 {
		t.Fatalf("backends: exit %d", code)
	}
	ucxLine := "build with -tags ucx (needs libucx-dev)" // a binary without UCX says how to get it
	if _, err := transport.Get("ucx"); err == nil {
		ucxLine = "built in"
	}
	mpiLine := "build with -tags mpi (needs libopenmpi-dev)"
	if _, err := transport.Get("mpi"); err == nil {
		mpiLine = "built in; MPI moves data"
	}
	for _, want := range []string{"TCP", "SHM", "UCX", ucxLine, "NIXL", "MPI", mpiLine, "a rank that dies takes the whole world down", "AUTO"} {
		if !strings.Contains(out, want) {
			t.Errorf("backends lacks %q:\n%s", want, out)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	code, _, errw := runWith(t, nil, "config", "check")
	if code != 2 || !strings.Contains(errw, "requires at least 1 arg") {
		t.Errorf("config check without files: exit %d, %q", code, errw)
	}
	code, _, errw = runWith(t, nil, "frobnicate")
	if code != 2 || !strings.Contains(errw, "unknown command") {
		t.Errorf("unknown verb: exit %d, %q", code, errw)
	}
}

// TestServeListenFDRefusesWhatIsNotASocket: an inherited fd must be a
// listening socket at fd 3 or above, and the error says which.
func TestServeListenFDRefusesWhatIsNotASocket(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "notasocket")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// A copy of the descriptor: serve closes the one it is given.
	fd, err := syscall.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ fd, want string }{
		{"2", "--listen-fd 2: an inherited socket is fd 3 or above"},
		{strconv.Itoa(fd), "is not a listening socket"},
	} {
		code, _, errw := runWith(t, nil, "serve", "--role", "both", "--listen-fd", c.fd)
		if code == 0 || !strings.Contains(errw, c.want) {
			t.Errorf("--listen-fd %s: exit %d, stderr lacks %q:\n%s", c.fd, code, c.want, errw)
		}
	}
}
