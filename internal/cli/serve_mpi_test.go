package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
)

// TestServeMPINotBuilt: a binary without -tags mpi says how to get
// serve-mpi.
func TestServeMPINotBuilt(t *testing.T) {
	if mpiWorld != nil {
		t.Skip("this test binary has the MPI backend")
	}
	code, _, errw := runWith(t, nil, "serve-mpi", "-c", "../../config/testdata/upstream/cluster_mpi.yaml")
	if code == 0 || !strings.Contains(errw, "build with -tags mpi") {
		t.Errorf("serve-mpi without the backend: exit %d, %q", code, errw)
	}
}

// TestUpSmokeMPI is kvxfer up --smoke with backend MPI: the workers run as
// one MPI world under mpirun, their KV cache moves over MPI, and every
// answer through the router equals the aggregated worker's.
func TestUpSmokeMPI(t *testing.T) {
	if mpiWorld == nil {
		t.Skip("needs the MPI backend: go test -tags mpi (make mpi)")
	}
	if _, err := exec.LookPath("mpirun"); err != nil {
		t.Fatalf("mpirun: %v (make deps installs openmpi-bin)", err)
	}
	cases := []struct {
		name, yaml string
		env        []string
	}{
		{"explicit", `
context_servers:
  tensor_parallel_size: 2
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: MPI, kv_transfer_timeout_ms: 10000}
generation_servers:
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: MPI, kv_transfer_timeout_ms: 10000}
`, nil},
		{"default with TRTLLM_USE_MPI_KVCACHE", string(launch.DefaultCluster), []string{config.EnvUseMPI + "=1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, err := config.LoadBytes("cluster.yaml", []byte(c.yaml), config.Env{})
			if err != nil {
				t.Fatal(err)
			}
			f.Cluster.Port = -1
			var logs, out syncbuf.Buffer
			tmp := t.TempDir() // the workers' TMPDIR: serve-mpi leaves nothing in it
			l, err := launch.Start(context.Background(), launch.Options{Cluster: f.Cluster, Aggregated: true,
				Command: []string{os.Args[0]}, Env: append([]string{"KVXFER_CLI_CHILD=1", "TMPDIR=" + tmp}, c.env...), Output: &out,
				Logger: slog.New(slog.NewTextHandler(&logs, nil)), Ready: 90 * time.Second})
			if err != nil {
				t.Fatalf("launch: %v\n%s\n%s", err, logs.String(), out.String())
			}
			defer func() {
				l.Stop()
				if t.Failed() {
					t.Logf("launcher:\n%s\nworkers:\n%s", logs.String(), out.String())
				}
			}()
			if !strings.Contains(logs.String(), "workers started as one MPI world") || !strings.Contains(logs.String(), "takes the whole world down") {
				t.Errorf("the launcher did not say it started one MPI world, and why")
			}
			res := launch.Smoke(context.Background(), l.RouterURL, l.AggregatedURL, 16, 4)
			if !res.OK() {
				t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
			}
			for _, u := range []string{l.ContextURLs[0], l.GenerationURL[0]} {
				if n := mpiBytes(t, u); n == 0 {
					t.Errorf("%s moved no KV cache over MPI", u)
				}
			}
			l.Stop()
			if left, _ := filepath.Glob(filepath.Join(tmp, "kvxfer-serve-mpi-*")); len(left) > 0 {
				t.Errorf("serve-mpi left its worker files behind: %v", left)
			}
		})
	}
}

var mpiBytesRE = regexp.MustCompile(`kvxfer_transfer_bytes_total\{backend="mpi",role="[a-z]+"\} ([0-9.e+]+)`)

// mpiBytes returns the worker's KV-cache bytes moved over MPI (0: none).
func mpiBytes(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	m := mpiBytesRE.FindSubmatch(b)
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("%s/metrics: %q: %v", url, m[0], err)
	}
	return v
}

// TestServeMPIUpstreamShape runs a cluster file in the shape of
// TensorRT-LLM's MPI worker test (LLM options at the top level, backend
// MPI, a TP2 context server and a TP1 generation server) as TensorRT-LLM
// runs it: mpirun with one rank per model rank (3) running serve-mpi, the
// router started on its own. The context instance's second rank holds its
// place; the answers through the router equal an aggregated worker's.
func TestServeMPIUpstreamShape(t *testing.T) {
	if mpiWorld == nil {
		t.Skip("needs the MPI backend: go test -tags mpi (make mpi)")
	}
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Fatalf("mpirun: %v (make deps installs openmpi-bin)", err)
	}
	ports := freePorts(t, 4)
	addr := func(i int) string { return "127.0.0.1:" + strconv.Itoa(ports[i]) }
	file := filepath.Join(t.TempDir(), "disagg_config.yaml")
	text := fmt.Sprintf(`hostname: 127.0.0.1
port: %d
model: meta-llama/Llama-3.1-8B-Instruct
backend: "pytorch"
disable_overlap_scheduler: True
kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
context_servers:
  num_instances: 1
  tensor_parallel_size: 2
  cache_transceiver_config:
    backend: MPI
  urls:
      - "%s"
generation_servers:
  num_instances: 1
  tensor_parallel_size: 1
  cache_transceiver_config:
    backend: MPI
  urls:
      - "%s"
`, ports[2], addr(0), addr(1))
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	var out syncbuf.Buffer
	// The processes' TMPDIR, checked once they have all stopped (this
	// cleanup runs after theirs): mpirun ends its ranks faster than a
	// worker's own shutdown, and serve-mpi must leave nothing behind.
	tmp := t.TempDir()
	t.Cleanup(func() {
		if left, _ := filepath.Glob(filepath.Join(tmp, "kvxfer-serve-mpi-*")); len(left) > 0 {
			t.Errorf("serve-mpi left its worker files behind: %v", left)
		}
	})
	start := func(name string, c *exec.Cmd) {
		c.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1", "TMPDIR="+tmp)
		if os.Geteuid() == 0 {
			c.Env = append(c.Env, launch.MPIRootEnv...)
		}
		c.Stdout, c.Stderr = &out, &out
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
		if err := c.Start(); err != nil {
			t.Fatalf("start %s: %v", name, err)
		}
		done := make(chan struct{})
		go func() { c.Wait(); close(done) }()
		t.Cleanup(func() {
			c.Process.Signal(syscall.SIGTERM)
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				c.Process.Kill()
				<-done
			}
		})
	}
	start("mpirun", exec.Command(mpirun, "-np", "3", "--oversubscribe", "--bind-to", "none", "--tag-output",
		os.Args[0], "serve-mpi", "-c", file))
	start("router", exec.Command(os.Args[0], "router", "--config", file, "--port", strconv.Itoa(ports[2])))
	start("aggregated", exec.Command(os.Args[0], "serve", "--role", "both", "--host", "127.0.0.1", "--port", strconv.Itoa(ports[3])))
	defer func() {
		if t.Failed() {
			t.Logf("logs:\n%s", out.String())
		}
	}()
	for _, a := range []string{addr(0), addr(1), addr(3)} {
		waitHTTP(t, "http://"+a+"/health", 90*time.Second)
	}
	router := "http://" + addr(2)
	waitHTTP(t, router+"/health", 30*time.Second)
	res := launch.Smoke(context.Background(), router, "http://"+addr(3), 8, 4)
	if !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
	if !strings.Contains(out.String(), "holds its place in the world") {
		t.Errorf("the context instance's second rank did not say it holds its place")
	}
	for _, u := range []string{"http://" + addr(0), "http://" + addr(1)} {
		if mpiBytes(t, u) == 0 {
			t.Errorf("%s moved no KV cache over MPI", u)
		}
	}
}

func freePorts(t *testing.T, n int) []int {
	t.Helper()
	ps, err := freeport.Ports(n)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

// waitHTTP waits until url answers 200, failing t after within.
func waitHTTP(t *testing.T, url string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy after %v (last: %v)", url, within, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestServeMPIRankFails: a rank that cannot serve (its port is taken)
// aborts the MPI world, so mpirun ends promptly with an error instead of
// the other ranks waiting for it.
func TestServeMPIRankFails(t *testing.T) {
	if mpiWorld == nil {
		t.Skip("needs the MPI backend: go test -tags mpi (make mpi)")
	}
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Fatalf("mpirun: %v (make deps installs openmpi-bin)", err)
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	free := freePorts(t, 1)[0]
	file := filepath.Join(t.TempDir(), "disagg_config.yaml")
	text := fmt.Sprintf("context_servers:\n  cache_transceiver_config: {backend: MPI}\n  urls: [\"127.0.0.1:%d\"]\n"+
		"generation_servers:\n  cache_transceiver_config: {backend: MPI}\n  urls: [%q]\n", free, taken.Addr().String())
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := exec.CommandContext(ctx, mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", os.Args[0], "serve-mpi", "-c", file)
	c.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1")
	if os.Geteuid() == 0 {
		c.Env = append(c.Env, launch.MPIRootEnv...)
	}
	out, err := c.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("mpirun still running after 60 s: the failed rank did not take the world down\n%s", out)
	}
	if err == nil || !strings.Contains(string(out), "aborting the MPI world") {
		t.Fatalf("mpirun: %v, want a failure that says the world was aborted\n%s", err, out)
	}
}
