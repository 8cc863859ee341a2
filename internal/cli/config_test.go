package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// corpus lists the files of config's corpus of upstream shapes, those that
// must load and those that must be refused (named refused_*).
func corpus(t *testing.T) (load, refuse []string) {
	t.Helper()
	dir := filepath.Join("..", "..", "config", "testdata", "upstream")
	for _, pat := range []string{"*.yaml", "*.yml"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		for _, p := range m {
			if strings.HasPrefix(filepath.Base(p), "refused_") {
				refuse = append(refuse, p)
			} else {
				load = append(load, p)
			}
		}
	}
	if len(load)+len(refuse) < 30 {
		t.Fatalf("corpus has %d files", len(load)+len(refuse))
	}
	return load, refuse
}

// TestConfigCheckUpstreamCorpus is the acceptance check: config
// check exits 0 on every upstream file shape, and 1 on those kvxfer must
// refuse, each named in one error.
func TestConfigCheckUpstreamCorpus(t *testing.T) {
	load, refuse := corpus(t)
	code, out, errw := runWith(t, nil, append([]string{"config", "check"}, load...)...)
	if code != 0 {
		t.Fatalf("config check on %d upstream shapes: exit %d\n%s", len(load), code, errw)
	}
	if n := strings.Count(out, " file, valid\n"); n != len(load) {
		t.Errorf("%d files reported valid, want %d", n, len(load))
	}
	for _, p := range refuse {
		code, _, errw := runWith(t, nil, "config", "check", p)
		if code != 1 || !strings.Contains(errw, "error: "+p) {
			t.Errorf("%s: exit %d, want 1 with its error:\n%s", p, code, errw)
		}
	}
}

func TestConfigCheckDir(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("clean.yaml", "cache_transceiver_config:\n  backend: TCP\n")
	write("sub/warned.yml", "max_batch_size: 8\ncache_transceiver_config:\n  backend: tcp\n  transceiver_runtime: CPP\n")
	write("notes.txt", "not a config")

	code, out, errw := runWith(t, nil, "config", "check", dir)
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errw)
	}
	for _, want := range []string{
		filepath.Join(dir, "clean.yaml") + ": worker file, valid\n",
		filepath.Join(dir, "sub", "warned.yml") + ": worker file, valid, 3 warnings: 1 accepted, not applied, 1 older form, 1 not used by kvxfer\n",
		": 2 files: 1 valid, 1 valid with warnings, 0 invalid",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "backend: TCP #") {
		t.Errorf("a directory check printed a full report:\n%s", out)
	}

	code, out, _ = runWith(t, nil, "config", "check", "--strict", dir)
	if code != 1 || !strings.Contains(out, "warned.yml: worker file, invalid (--strict), 3 warnings") || !strings.Contains(out, "1 valid, 0 valid with warnings, 1 invalid") {
		t.Errorf("--strict: exit %d\n%s", code, out)
	}

	write("broken.yaml", "cache_transceiver_config:\n  backend: RDMA\n")
	code, out, errw = runWith(t, nil, "config", "check", dir)
	if code != 1 || !strings.Contains(out, "broken.yaml: worker file, invalid (1 error)") || !strings.Contains(errw, `unknown backend "RDMA"`) {
		t.Errorf("with an invalid file: exit %d\n%s\n%s", code, out, errw)
	}
}

// TestConfigCheckStrict: --strict turns every warning into an error; a
// file without warnings stays valid.
func TestConfigCheckStrict(t *testing.T) {
	code, _, _ := runWith(t, nil, "config", "check", "--strict", example("worker.yaml"))
	if code != 1 {
		t.Errorf("--strict on a file with warnings: exit %d", code)
	}
	dir := t.TempDir()
	clean := filepath.Join(dir, "clean.yaml")
	os.WriteFile(clean, []byte("cache_transceiver_config:\n  backend: TCP\n"), 0o644)
	if code, _, errw := runWith(t, nil, "config", "check", "--strict", clean); code != 0 {
		t.Errorf("--strict on a clean file: exit %d\n%s", code, errw)
	}
}

// TestConfigCheckNotApplied: kv_transfer_sender_future_timeout_ms and
// TRTLLM_UCX_INTERFACE are applied, not listed as accepted without an
// effect, TRTLLM_USE_NIXL_KVCACHE=1 under DEFAULT resolves to AUTO
// with a warning naming it, and an interface that does not exist is an
// error naming those that do.
func TestConfigCheckNotApplied(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "w.yaml")
	os.WriteFile(f, []byte("cache_transceiver_config:\n  backend: DEFAULT\n  kv_transfer_sender_future_timeout_ms: 3000\n"), 0o644)
	code, out, errw := runWith(t, map[string]string{"TRTLLM_USE_NIXL_KVCACHE": "1", "TRTLLM_UCX_INTERFACE": "lo"}, "config", "check", f)
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errw)
	}
	for _, want := range []string{
		"DEFAULT → AUTO: backend DEFAULT resolved to AUTO: TRTLLM_USE_NIXL_KVCACHE=1 asks for NIXL",
		"UCX listener and side channel interface: lo (env TRTLLM_UCX_INTERFACE)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out+errw, "not applied") {
		t.Errorf("kv_transfer_sender_future_timeout_ms or TRTLLM_UCX_INTERFACE listed as not applied:\n%s\n%s", out, errw)
	}
	if !strings.Contains(errw, "warning: "+f+": cache_transceiver_config.backend: TRTLLM_USE_NIXL_KVCACHE=1 asks DEFAULT for NIXL") {
		t.Errorf("no resolution warning:\n%s", errw)
	}
	code, _, errw = runWith(t, map[string]string{"TRTLLM_UCX_INTERFACE": "no-such-nic0"}, "config", "check", f)
	if code != 1 || !strings.Contains(errw, `env TRTLLM_UCX_INTERFACE: no network interface "no-such-nic0" on this host (it has: lo`) {
		t.Errorf("missing interface: exit %d\n%s", code, errw)
	}
}

// TestRouterAndUpRefuse: a file that loads (config check exits 0) but that
// the router or the launcher cannot run yet is refused by them, by name,
// before anything listens or starts.
func TestRouterAndUpRefuse(t *testing.T) {
	up := func(name string) string { return filepath.Join("..", "..", "config", "testdata", "upstream", name) }
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"router", "--config", up("cluster_gen_only.yaml"), "--port", "0"}, "context_servers.num_instances is 0, TensorRT-LLM's generation-only benchmark mode, which kvxfer router does not support yet"},
		// The built-in store on every interface without a cluster secret.
		{[]string{"router", "--config", up("cluster_disagg_cluster.yaml"), "--port", "0", "--host", "0.0.0.0"}, "on a non-loopback address needs a cluster secret"},
		{[]string{"up", "-f", up("cluster_gen_only_moe.yaml"), "--port", "0"}, "context_servers.num_instances is 0, TensorRT-LLM's generation-only benchmark mode, which kvxfer up does not support yet"},
		{[]string{"up", "-f", up("cluster_disagg_cluster.yaml"), "--port", "0"}, "the file uses disagg_cluster"},
	} {
		code, _, errw := runWith(t, nil, tc.args...)
		if code == 0 || !strings.Contains(errw, tc.want) {
			t.Errorf("%v: exit %d\n%s\nwant %q", tc.args, code, errw, tc.want)
		}
	}
}
