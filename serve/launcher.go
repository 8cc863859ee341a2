package serve

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/metrics"
)

// DefaultCluster is the cluster `kvxfer up` starts without -f: one context
// worker with TP2, one generation worker with TP1, the GQA model, backend
// DEFAULT.
//
//go:embed default_cluster.yaml
var DefaultCluster []byte

// LaunchOptions configure Launch.
type LaunchOptions struct {
	// Cluster is the loaded cluster file.
	Cluster *config.Cluster
	// Command starts a worker: it is run with the worker's arguments
	// appended (serve --role ... --config ... --port ...). Nil means this
	// executable.
	Command []string
	// Model is the engine preset every worker serves.
	Model string
	// Aggregated also starts one worker with role both (TP1), for
	// comparisons (up --smoke).
	Aggregated bool
	// Port of the router; 0 means the cluster file's port.
	Port int
	// Host the router listens on; "" means the cluster file's hostname.
	Host string
	// Output receives the workers' logs, each line prefixed with the
	// worker's name; nil discards them.
	Output io.Writer
	Logger *slog.Logger
	// Env is added to the workers' environment.
	Env []string
	// Ready bounds the wait for every worker to become healthy.
	Ready time.Duration
	// HTTP bounds the router's connections; zero fields take the defaults.
	HTTP HTTPLimits
}

// Launched is a running cluster: worker processes and the router.
type Launched struct {
	RouterURL     string
	ContextURLs   []string
	GenerationURL []string
	AggregatedURL string // "" unless LaunchOptions.Aggregated

	router  *Router
	server  *http.Server
	ln      net.Listener
	workers []*worker
	dir     string
	log     *slog.Logger
	wg      sync.WaitGroup
	stopped sync.Once
}

type worker struct {
	name string
	url  string
	cmd  *exec.Cmd
	done chan error
}

// Launch starts every worker of the cluster as its own process, waits until
// each answers /health, and starts the router in this process. On error,
// whatever was started is stopped.
func Launch(ctx context.Context, o LaunchOptions) (*Launched, error) {
	if o.Cluster == nil {
		return nil, errors.New("serve: launch: no cluster")
	}
	cl := o.Cluster
	if o.Model == "" {
		o.Model = "tiny-gqa"
	}
	if o.Ready == 0 {
		o.Ready = 60 * time.Second
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cmd := o.Command
	if len(cmd) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cmd = []string{exe}
	}
	dir, err := os.MkdirTemp("", "kvxfer-up-")
	if err != nil {
		return nil, err
	}
	l := &Launched{dir: dir, log: log}
	fail := func(err error) (*Launched, error) {
		l.Stop()
		return nil, err
	}
	start := func(role string, idx int, g *config.ServerGroup, tp, pp int) (string, error) {
		addr, err := groupAddr(g, idx)
		if err != nil {
			return "", err
		}
		name := fmt.Sprintf("%s-%d", role, idx)
		cfgPath := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(cfgPath, workerYAML(g, tp, pp), 0o600); err != nil {
			return "", err
		}
		host, port, _ := net.SplitHostPort(addr)
		args := append(append([]string{}, cmd[1:]...), "serve", "--role", role, "--config", cfgPath,
			"--model", o.Model, "--host", host, "--port", port)
		w := &worker{name: name, url: "http://" + addr, done: make(chan error, 1)}
		w.cmd = exec.Command(cmd[0], args...)
		w.cmd.Env = append(os.Environ(), o.Env...)
		out := o.Output
		if out == nil {
			out = io.Discard
		}
		pw := &prefixWriter{w: out, prefix: "[" + name + "] "}
		w.cmd.Stdout, w.cmd.Stderr = pw, pw
		// Children die with the launcher even if it is killed.
		w.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
		if err := w.cmd.Start(); err != nil {
			return "", fmt.Errorf("serve: start %s: %w", name, err)
		}
		l.workers = append(l.workers, w)
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			w.done <- w.cmd.Wait()
			close(w.done)
		}()
		log.Info("worker started", "name", name, "pid", w.cmd.Process.Pid, "url", w.url)
		return w.url, nil
	}
	for i := range cl.Context.NumInstances {
		u, err := start("context", i, &cl.Context, cl.Context.TensorParallelSize, cl.Context.PipelineParallelSize)
		if err != nil {
			return fail(err)
		}
		l.ContextURLs = append(l.ContextURLs, u)
	}
	for i := range cl.Generation.NumInstances {
		u, err := start("generation", i, &cl.Generation, cl.Generation.TensorParallelSize, cl.Generation.PipelineParallelSize)
		if err != nil {
			return fail(err)
		}
		l.GenerationURL = append(l.GenerationURL, u)
	}
	if o.Aggregated {
		agg := cl.Generation
		agg.URLs = nil
		u, err := start("both", 0, &agg, 1, 1)
		if err != nil {
			return fail(err)
		}
		l.AggregatedURL = u
	}
	if err := l.waitHealthy(ctx, o.Ready); err != nil {
		return fail(err)
	}
	r, err := NewRouter(RouterOptions{Context: l.ContextURLs, Generation: l.GenerationURL,
		ContextPolicy: Policy(cl.Context.Router), GenerationPolicy: Policy(cl.Generation.Router), Logger: log})
	if err != nil {
		return fail(err)
	}
	l.router = r
	host := o.Host
	if host == "" {
		host = cl.Hostname
	}
	port := o.Port
	if port == 0 {
		port = cl.Port
	}
	if port < 0 {
		port = 0
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return fail(fmt.Errorf("serve: router listen: %w", err))
	}
	log.Info("listening", "plane", "router http", "addr", ln.Addr().String())
	l.ln = LimitListener(ln, "router http", o.HTTP, log, metrics.NewConns(r.Registry()))
	l.RouterURL = "http://" + ln.Addr().String()
	l.server = NewHTTPServer(r.Handler(), o.HTTP)
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.server.Serve(l.ln)
	}()
	return l, nil
}

// groupAddr returns the host:port of instance idx of a group: its URL, or a
// free loopback port.
func groupAddr(g *config.ServerGroup, idx int) (string, error) {
	if idx < len(g.URLs) {
		u := strings.TrimPrefix(strings.TrimPrefix(g.URLs[idx], "http://"), "https://")
		return u, nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// workerYAML writes the worker file of one server group.
func workerYAML(g *config.ServerGroup, tp, pp int) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "tensor_parallel_size: %d\npipeline_parallel_size: %d\n", tp, pp)
	fmt.Fprintf(&b, "kv_cache_config:\n  tokens_per_block: %d\n  max_tokens: %d\n", g.KVCache.TokensPerBlock, g.KVCache.MaxTokens)
	if ct := g.CacheTransceiver; ct != nil && ct.Backend != config.BackendUnset {
		fmt.Fprintf(&b, "cache_transceiver_config:\n  backend: %s\n  kv_transfer_timeout_ms: %d\n", ct.Backend, ct.KVTransferTimeoutMs)
		if ct.MaxTokensInBuffer > 0 {
			fmt.Fprintf(&b, "  max_tokens_in_buffer: %d\n", ct.MaxTokensInBuffer)
		}
	}
	return b.Bytes()
}

func (l *Launched) waitHealthy(ctx context.Context, within time.Duration) error {
	deadline := time.Now().Add(within)
	client := &http.Client{Timeout: time.Second}
	defer client.CloseIdleConnections()
	for _, w := range l.workers {
		for {
			select {
			case err := <-w.done:
				return fmt.Errorf("serve: worker %s exited before it was healthy: %v", w.name, err)
			default:
			}
			resp, err := client.Get(w.url + "/health")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("serve: worker %s not healthy within %v", w.name, within)
			}
			select {
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	return nil
}

// Stop stops the router, then every worker: SIGTERM, and SIGKILL for those
// still running after 10 s. It removes the generated worker files.
// Idempotent.
func (l *Launched) Stop() {
	l.stopped.Do(func() {
		if l.server != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			l.server.Shutdown(ctx)
			cancel()
		}
		if l.router != nil {
			l.router.Close()
		}
		for _, w := range l.workers {
			w.cmd.Process.Signal(syscall.SIGTERM)
		}
		for _, w := range l.workers {
			select {
			case <-w.done:
			case <-time.After(10 * time.Second):
				l.log.Warn("worker did not stop, killing it", "name", w.name)
				w.cmd.Process.Kill()
				<-w.done
			}
		}
		l.wg.Wait()
		os.RemoveAll(l.dir)
	})
}

// Workers returns the name and PID of every worker process.
func (l *Launched) Workers() map[string]int {
	out := map[string]int{}
	for _, w := range l.workers {
		out[w.name] = w.cmd.Process.Pid
	}
	return out
}

// prefixWriter prefixes every line written through it.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
	buf    []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = append(p.buf, b...)
	for {
		i := bytes.IndexByte(p.buf, '\n')
		if i < 0 {
			break
		}
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.buf[:i])
		p.buf = p.buf[i+1:]
	}
	if len(p.buf) > 64<<10 {
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.buf)
		p.buf = p.buf[:0]
	}
	return len(b), nil
}
