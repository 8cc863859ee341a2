package cli

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/launch"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
)

// TestCerts: kvxfer certs writes files that load and verify, keys 0600,
// and refuses to overwrite them without --force.
func TestCerts(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	code, out, errw := runWith(t, nil, "certs", "--out", dir, "--hosts", "10.0.0.5,node1", "--names", "ctx0,gen0,router", "--validity", "48h")
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out, errw)
	}
	if !strings.Contains(out, "--tls-cert "+filepath.Join(dir, "ctx0.pem")) {
		t.Errorf("output does not say how to use the files:\n%s", out)
	}
	for _, n := range []string{"ctx0", "gen0", "router"} {
		f := tlsconf.Files{CertFile: filepath.Join(dir, n+".pem"), KeyFile: filepath.Join(dir, n+"-key.pem"), CAFile: filepath.Join(dir, "ca.pem")}
		c, err := tlsconf.Load(f)
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		if err := c.Leaf.VerifyHostname("node1"); err != nil {
			t.Errorf("%s: %v", n, err)
		}
		if d := time.Until(c.Leaf.NotAfter); d > 48*time.Hour || d < 47*time.Hour {
			t.Errorf("%s: valid for another %v, want 48h", n, d)
		}
		if fi, err := os.Stat(f.KeyFile); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: key file mode %v (%v), want 0600", n, fi.Mode().Perm(), err)
		}
	}
	if code, _, errw := runWith(t, nil, "certs", "--out", dir); code == 0 || !strings.Contains(errw, "already exists") {
		t.Errorf("second run without --force: exit %d, %s", code, errw)
	}
	if code, _, errw := runWith(t, nil, "certs", "--out", dir, "--force"); code != 0 {
		t.Errorf("with --force: exit %d, %s", code, errw)
	}
	if code, _, errw := runWith(t, nil, "certs"); code == 0 || !strings.Contains(errw, "--out") {
		t.Errorf("without --out: exit %d, %s", code, errw)
	}
	if code, _, errw := runWith(t, nil, "serve", "--tls-cert", filepath.Join(dir, "ctx0.pem")); code == 0 || !strings.Contains(errw, "--tls-cert/--tls-key/--tls-ca") {
		t.Errorf("serve with a certificate only: exit %d, %s", code, errw)
	}
}

const tcpCluster = `
context_servers:
  tensor_parallel_size: 2
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: TCP, kv_transfer_timeout_ms: 5000}
generation_servers:
  kv_cache_config: {tokens_per_block: 16, max_tokens: 8192}
  cache_transceiver_config: {backend: TCP, kv_transfer_timeout_ms: 5000}
`

// TestUpTLSSmoke is kvxfer up --tls --smoke with the tcp backend: workers
// serve HTTPS with client certificates and transfer over TLS, the router
// reaches them, every answer equals the aggregated worker's; a plain client
// cannot reach a worker.
func TestUpTLSSmoke(t *testing.T) {
	f, err := config.LoadBytes("cluster.yaml", []byte(tcpCluster), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	f.Cluster.Port = -1
	logs := &syncbuf.Buffer{}
	l, err := launch.Start(context.Background(), launch.Options{Cluster: f.Cluster, Aggregated: true, GenerateTLS: true,
		Command: []string{os.Args[0]}, Env: []string{"KVXFER_CLI_CHILD=1"}, Output: logs, Ready: 60 * time.Second})
	if err != nil {
		t.Fatalf("launch: %v\n%s", err, logs.String())
	}
	t.Cleanup(func() {
		l.Stop()
		if t.Failed() {
			t.Logf("worker logs:\n%s", logs.String())
		}
	})
	for _, u := range append(append([]string{l.AggregatedURL}, l.ContextURLs...), l.GenerationURL...) {
		if !strings.HasPrefix(u, "https://") {
			t.Errorf("worker URL %s, want https", u)
		}
	}
	res := launch.SmokeWith(context.Background(), l.Client(), l.RouterURL, l.AggregatedURL, 4, 2)
	if !res.OK() {
		t.Fatalf("smoke: %d/%d matched: %v", res.Matched, res.Prompts, res.Failures)
	}
	resp, err := l.Client().Get(l.GenerationURL[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(m), `kvxfer_transfer_bytes_total{backend="tcp(tls)",role="generation"}`) {
		t.Errorf("the generation worker's transfers were not carried by tcp(tls):\n%s", grepLines(string(m), "kvxfer_transfer_bytes_total"))
	}
	c := &http.Client{Timeout: 5 * time.Second}
	defer c.CloseIdleConnections()
	if resp, err := c.Get(l.ContextURLs[0] + "/health"); err == nil {
		resp.Body.Close()
		t.Errorf("a client without the cluster's CA reached a worker: %d", resp.StatusCode)
	}
	if !strings.Contains(logs.String(), "mutual_tls=true") {
		t.Errorf("workers do not say they serve mutual TLS:\n%s", logs.String())
	}
	if strings.Contains(logs.String(), "refused") {
		t.Errorf("a member was refused:\n%s", logs.String())
	}
}

func grepLines(s, sub string) string {
	var out []string
	for line := range strings.Lines(s) {
		if strings.Contains(line, sub) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "")
}
