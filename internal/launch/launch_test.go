package launch

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/serve"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if fakeWorkerMain() {
		return
	}
	goleak.VerifyTestMain(m)
}

func cluster(t *testing.T, text string) *config.Cluster {
	t.Helper()
	f, err := config.LoadBytes("c.yaml", []byte(text), config.Env{})
	if err != nil {
		t.Fatal(err)
	}
	return f.Cluster
}

// TestStartable: the shapes kvxfer up refuses, each with a message that
// names the setting and why, before anything starts.
func TestStartable(t *testing.T) {
	for _, tc := range []struct{ text, want string }{
		{"context_servers: {}\ngeneration_servers: {}\n", ""},
		{"context_servers: {num_instances: 0}\ngeneration_servers: {}\n", "context_servers.num_instances is 0, TensorRT-LLM's generation-only benchmark mode, which kvxfer up does not support yet"},
		{"context_servers: {}\ngeneration_servers: {num_instances: 0}\n", "generation_servers.num_instances is 0"},
		{"disagg_cluster: {cluster_uri: 'http://h:8000'}\n", "context_servers has no instances to start: the file uses disagg_cluster"},
	} {
		err := Startable(cluster(t, tc.text))
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%q: %v, want %q", tc.text, err, tc.want)
		}
		if tc.want != "" {
			if _, err := Start(t.Context(), Options{Cluster: cluster(t, tc.text)}); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Start %q: %v", tc.text, err)
			}
		}
	}
}

// TestWorkerYAMLDefaultBackend: a group without a transceiver config gets
// backend DEFAULT in the worker files kvxfer up writes; one with a config
// keeps it, the sender timeout too; each loads as a worker file.
func TestWorkerYAMLDefaultBackend(t *testing.T) {
	cl := cluster(t, `context_servers: {urls: ['localhost:9001']}
generation_servers:
  cache_transceiver_config: {backend: TCP, max_tokens_in_buffer: 64, kv_transfer_sender_future_timeout_ms: 900}
`)
	for _, tc := range []struct {
		g    *config.ServerGroup
		want config.CacheTransceiver
	}{
		{&cl.Context, config.CacheTransceiver{Backend: config.BackendDefault, KVTransferTimeoutMs: config.DefaultKVTransferTimeoutMs}},
		{&cl.Generation, config.CacheTransceiver{Backend: config.BackendTCP, KVTransferTimeoutMs: config.DefaultKVTransferTimeoutMs,
			MaxTokensInBuffer: 64, SenderFutureTimeoutMs: 900}},
	} {
		text := workerYAML(tc.g, &cl.Security, 1, 1)
		f, err := config.LoadBytes("w.yaml", text, config.Env{})
		if err != nil || f.Kind != config.KindWorker {
			t.Fatalf("%s: %v", text, err)
		}
		ct := f.Worker.CacheTransceiver
		if ct.Backend != tc.want.Backend || ct.KVTransferTimeoutMs != tc.want.KVTransferTimeoutMs ||
			ct.MaxTokensInBuffer != tc.want.MaxTokensInBuffer || ct.SenderFutureTimeoutMs != tc.want.SenderFutureTimeoutMs {
			t.Errorf("%s: loaded %+v", text, *ct)
		}
	}
}

// TestRouterDeadlines: the router kvxfer up starts takes the deadlines of
// its options (kvxfer up's --header-timeout and the others), and the
// defaults for those left zero.
func TestRouterDeadlines(t *testing.T) {
	cl := cluster(t, "context_servers: {urls: ['127.0.0.1:1']}\ngeneration_servers: {urls: ['127.0.0.1:2']}\n")
	l := &Launched{ContextURLs: []string{"http://127.0.0.1:1"}, GenerationURL: []string{"http://127.0.0.1:2"},
		log: slog.New(slog.DiscardHandler)}
	defer l.Stop()
	d := serve.RouterDeadlines{HeaderTimeout: 7 * time.Second, ProbeInterval: 3 * time.Second}
	if err := l.startRouter(Options{Cluster: cl, Host: "127.0.0.1", Port: -1, Deadlines: d}, nil); err != nil {
		t.Fatal(err)
	}
	want := serve.RouterDeadlines{HeaderTimeout: 7 * time.Second, ChunkTimeout: serve.DefaultChunkTimeout,
		HealthTimeout: serve.DefaultHealthTimeout, ProbeInterval: 3 * time.Second}
	if got := l.router.Deadlines(); got != want {
		t.Errorf("router deadlines %+v, want %+v", got, want)
	}
	if got := l.router.MigrationLimit(); got != serve.DefaultMigrationLimit {
		t.Errorf("router migration limit %d, want the default %d", got, serve.DefaultMigrationLimit)
	}
}

// TestRouterMigrationLimit: the router kvxfer up starts takes the
// migration limit of its options (kvxfer up's --migration-limit).
func TestRouterMigrationLimit(t *testing.T) {
	cl := cluster(t, "context_servers: {urls: ['127.0.0.1:1']}\ngeneration_servers: {urls: ['127.0.0.1:2']}\n")
	for _, c := range []struct{ set, want int }{{0, serve.DefaultMigrationLimit}, {3, 3}, {serve.MigrationOff, 0}} {
		l := &Launched{ContextURLs: []string{"http://127.0.0.1:1"}, GenerationURL: []string{"http://127.0.0.1:2"},
			log: slog.New(slog.DiscardHandler)}
		if err := l.startRouter(Options{Cluster: cl, Host: "127.0.0.1", Port: -1, MigrationLimit: c.set}, nil); err != nil {
			t.Fatal(err)
		}
		if got := l.router.MigrationLimit(); got != c.want {
			t.Errorf("MigrationLimit %d: the router's limit is %d, want %d", c.set, got, c.want)
		}
		l.Stop()
	}
}

// TestWorkerYAMLReuseKeys: the worker files kvxfer up writes carry the
// group's block reuse keys as the cluster file set them (unset stays
// unset: the worker's default) and its event buffer.
func TestWorkerYAMLReuseKeys(t *testing.T) {
	cl := cluster(t, `context_servers:
  kv_cache_config: {enable_block_reuse: false, enable_partial_reuse: true, event_buffer_max_size: 64}
generation_servers: {}
`)
	for _, tc := range []struct {
		g                     *config.ServerGroup
		block, partial, copyP *bool
		events                int
	}{
		{&cl.Context, new(false), new(true), nil, 64},
		{&cl.Generation, nil, nil, nil, 0},
	} {
		text := workerYAML(tc.g, &cl.Security, 1, 1)
		f, err := config.LoadBytes("w.yaml", text, config.Env{})
		if err != nil {
			t.Fatalf("%s: %v", text, err)
		}
		k := f.Worker.KVCache
		same := func(a, b *bool) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }
		if !same(k.EnableBlockReuse, tc.block) || !same(k.EnablePartialReuse, tc.partial) || !same(k.CopyOnPartialReuse, tc.copyP) ||
			k.EventBufferMaxSize != tc.events {
			t.Errorf("%s: loaded %+v", text, k)
		}
	}
}

// TestWorkerYAMLEtcdClient: the worker files kvxfer up writes carry the
// cluster's security.etcd block, so that its workers reach an etcd with
// TLS or authentication as the router does.
func TestWorkerYAMLEtcdClient(t *testing.T) {
	cl := cluster(t, `context_servers: {}
generation_servers: {}
security:
  etcd: {ca_file: "ca dir/etcd-ca.pem", cert_file: c.pem, key_file: k.pem, username: kvxfer, password_file: /run/pw}
`)
	text := workerYAML(&cl.Context, &cl.Security, 1, 1)
	f, err := config.LoadBytes("w.yaml", text, config.Env{})
	if err != nil {
		t.Fatalf("%s: %v", text, err)
	}
	if got := f.Worker.Security.Etcd; got != cl.Security.Etcd || got.CAFile != "ca dir/etcd-ca.pem" {
		t.Errorf("worker file's security.etcd %+v, want %+v\n%s", got, cl.Security.Etcd, text)
	}
}

// TestStartPortProblems: a cluster file whose workers' ports cannot all be
// bound (one given twice, the router's, one another process holds, a host
// that is not this one) fails Start before any worker starts, with an
// error naming the urls entry and why; before, the workers listed first
// had started (and begun to load their model) by the time the later one
// failed, with an error naming neither the entry nor the reason.
func TestStartPortProblems(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	heldAddr := held.Addr().String()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	freeAddr := free.Addr().String()
	free.Close()
	for _, tc := range []struct {
		name, ctx, gen string
		router         bool
		want           []string
	}{
		{"twice", freeAddr, freeAddr, false, []string{"context_servers.urls[0] and generation_servers.urls[0] are both " + freeAddr}},
		{"held", freeAddr, heldAddr, false, []string{"generation_servers.urls[0]: in use by another process", heldAddr}},
		{"router", freeAddr, "", true, []string{"generation_servers.urls[0]: the router's port"}},
		{"other host", freeAddr, "192.0.2.1:9001", false, []string{"generation_servers.urls[0]: not an address of this host", "kvxfer serve"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := -1
			gen := tc.gen
			if tc.router {
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				routerPort := ln.Addr().(*net.TCPAddr).Port
				ln.Close()
				port, gen = routerPort, fmt.Sprintf("127.0.0.1:%d", routerPort)
			}
			cl := cluster(t, fmt.Sprintf("hostname: 127.0.0.1\nport: 8000\ncontext_servers: {urls: [%q]}\ngeneration_servers: {urls: [%q]}\n", tc.ctx, gen))
			var logs syncbuf.Buffer
			l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: port, Host: "127.0.0.1", Ready: 5 * time.Second,
				Env: []string{fakeWorkerEnv + "=silent"}, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if l != nil {
				l.Stop()
			}
			if err == nil {
				t.Fatal("Start succeeded")
			}
			t.Logf("Start: %v", err)
			for _, want := range tc.want {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Start: %v\nwant it to contain %q", err, want)
				}
			}
			if strings.Contains(logs.String(), "worker started") {
				t.Errorf("Start failed (%v) after it started a worker:\n%s", err, logs.String())
			}
		})
	}
}
