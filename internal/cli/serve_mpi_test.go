package cli

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
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
			l, err := launch.Start(context.Background(), launch.Options{Cluster: f.Cluster, Aggregated: true,
				Command: []string{os.Args[0]}, Env: append([]string{"KVXFER_CLI_CHILD=1"}, c.env...), Output: &out,
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
