package launch

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	_ "embed"
	"encoding/hex"
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
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/membership/connect"
	"github.com/kvxfer/kvxfer/membership/memstore"
	"github.com/kvxfer/kvxfer/metrics"
	"github.com/kvxfer/kvxfer/serve"
)

// DefaultCluster is the cluster `kvxfer up` starts without -f: one context
// worker with TP2, one generation worker with TP1, the GQA model, backend
// DEFAULT.
//
//go:embed default_cluster.yaml
var DefaultCluster []byte

// Options configure Start.
type Options struct {
	// Cluster is the loaded cluster file.
	Cluster *config.Cluster
	// Command starts a worker: it is run with the worker's arguments
	// appended (serve --role ... --config ... --port ...). Nil means this
	// executable.
	Command []string
	// Model is the engine preset every worker serves; "" means
	// serve.DefaultModel.
	Model string
	// Aggregated also starts one worker with role both (TP1), for
	// comparisons (up --smoke).
	Aggregated bool
	// Port of the router; 0 means the cluster file's port, a negative one
	// any free port.
	Port int
	// Host the router listens on; "" means the cluster file's hostname.
	Host string
	// Output receives the workers' logs, each line prefixed with the
	// worker's name; nil discards them.
	Output io.Writer
	Logger *slog.Logger
	// Env is added to the workers' environment.
	Env []string
	// Secret is the cluster secret handed to every worker; nil means Start
	// generates one (32 random bytes) for this cluster. It reaches the
	// workers only through their environment (KVXFER_CLUSTER_SECRET,
	// hex), never on a command line or in a file.
	Secret []byte
	// Deadlines are the router's per-phase deadlines (zero fields: the
	// defaults).
	Deadlines serve.RouterDeadlines
	// MigrationLimit is the router's (serve.RouterOptions.MigrationLimit):
	// 0 means serve.DefaultMigrationLimit, serve.MigrationOff turns
	// migration off.
	MigrationLimit int
	// Ready bounds the wait for every worker to become healthy; 0 means
	// DefaultReady.
	Ready time.Duration
	// Kill, when closed, ends the workers at once wherever Stop waits for
	// them (also the Stop of a Start that fails): what kvxfer up does on a
	// second Ctrl-C. Nil: only Launched.Kill does.
	Kill <-chan struct{}
	// TLS, when it names files, turns on mutual TLS between the router and
	// the workers and on the workers' transfer planes, with the same
	// certificate for every worker and the router.
	TLS tlsconf.Files
	// GenerateTLS turns on mutual TLS with a CA and one certificate per
	// worker and for the router, made for this cluster into the launcher's
	// private directory and removed by Stop. It wins over TLS.
	GenerateTLS bool
	// HTTP bounds the router's connections; zero fields take the defaults.
	HTTP serve.HTTPLimits
}

// DefaultReady is how long Start waits for the workers to become healthy
// unless Options.Ready says otherwise.
const DefaultReady = 60 * time.Second

// stopGrace is how long Stop waits after SIGTERM before it kills the
// workers still running.
const stopGrace = 10 * time.Second

// Launched is a running cluster: worker processes and the router.
type Launched struct {
	RouterURL     string
	ContextURLs   []string
	GenerationURL []string
	AggregatedURL string // "" unless Options.Aggregated

	router *serve.Router
	client *http.Client // to the workers (mutual TLS when on)
	scheme string       // of the workers' URLs: "http://" or "https://"
	server *http.Server
	ln     net.Listener
	// routerLn is the router's listener, opened before any worker starts
	// (a taken port fails Start at once); startRouter serves it.
	routerLn net.Listener
	// workerLns are the workers' listeners by name, opened before any
	// worker starts (listenWorkers); startWorker hands each on.
	workerLns map[string]*net.TCPListener
	workers   []*worker
	// With disagg_cluster: the workers' cluster_uri, the stores to close
	// after the router, and the built-in store's Close, which also runs as
	// the router's shutdown begins (endPolls; Close is idempotent).
	clusterURI string
	closers    []func()
	endPolls   func()
	dir        string
	dirLock    *os.File // its flock held until Stop has removed dir (makeTempDir)
	log        *slog.Logger
	wg         sync.WaitGroup
	stopped    sync.Once
	// exits has a token after a worker process exits or the router stops
	// serving (Wait's wake-up).
	exits chan struct{}
	// routerErr is why the router's server stopped serving other than at
	// Stop, once it has.
	routerErr atomic.Pointer[error]
	// kill is Options.Kill.
	kill <-chan struct{}
}

type worker struct {
	name string
	url  string
	p    *proc
	// world: a rank of an MPI world, whose process (p) is the world's
	// mpirun, shared with every other worker.
	world bool
}

// label names w's process in an error: the worker, or the MPI world's
// mpirun (which ends when any rank does).
func (w *worker) label() string {
	if w.world {
		return "mpirun (the MPI world of every worker)"
	}
	return "worker " + w.name
}

// proc is a process the launcher started: a worker's, or the mpirun of an
// MPI world, whose proc every worker of the world shares.
type proc struct {
	cmd *exec.Cmd
	out *prefixWriter
	// done is closed once the process has exited and its output has been
	// read; err is then cmd.Wait's.
	done chan struct{}
	err  error
	// started is the process's start time (startTime), read once it has
	// started: kill reads its children only while its PID names it.
	started string
}

// startProc starts cmd with its output through a prefixWriter of prefix
// to out (nil: discarded, but its tail kept for errors), dying with this
// process, and waits for it in the background.
func (l *Launched) startProc(cmd *exec.Cmd, prefix string, out io.Writer) (*proc, error) {
	if out == nil {
		out = io.Discard
	}
	p := &proc{cmd: cmd, out: &prefixWriter{w: out, prefix: prefix}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	// Children die with the launcher even if it is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p.started = startTime(cmd.Process.Pid)
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		p.err = cmd.Wait()
		close(p.done)
		select {
		case l.exits <- struct{}{}:
		default:
		}
	}()
	return p, nil
}

// exitError is what a worker's process exit is reported as: its status
// and the last lines it wrote.
func (w *worker) exitError() string {
	return fmt.Sprintf("%v%s", w.p.err, w.p.out.tailText())
}

// Start starts every worker of the cluster as its own process, waits until
// each answers /health, and starts the router in this process. On error,
// whatever was started is stopped.
func Start(ctx context.Context, o Options) (*Launched, error) {
	if o.Cluster == nil {
		return nil, errors.New("launch: no cluster")
	}
	if err := Startable(o.Cluster); err != nil {
		return nil, err
	}
	if err := o.defaults(); err != nil {
		return nil, err
	}
	sweepTempDirs(os.TempDir(), o.Logger)
	dir, lock, err := makeTempDir(o.Logger)
	if err != nil {
		return nil, fmt.Errorf("launch: %w", err)
	}
	l := &Launched{dir: dir, dirLock: lock, log: o.Logger, exits: make(chan struct{}, 1), kill: o.Kill}
	if err := l.start(ctx, o); err != nil {
		l.Stop()
		return nil, err
	}
	return l, nil
}

// tempDirPrefix names the directories Start makes in os.TempDir() for the
// workers' files and certificates.
const tempDirPrefix = "kvxfer-up-"

// tempDirLock is the file in such a directory that its Start holds an
// exclusive flock on until Stop has removed the directory. The kernel
// releases it when the process ends, however it ends, so a later Start
// can tell the directory of an up that was killed (SIGKILL runs no
// cleanup) from one that still runs, in this PID namespace or another
// sharing the directory. (The workers of a killed up, which get SIGTERM,
// hold no lock: by then they have read their files.)
const tempDirLock = "lock"

// makeTempDir makes a directory for Start (0700) and returns it with its
// lock held. The lock file is locked under another name and renamed, so
// that a sweep never sees it unlocked. On a file system without flock
// (NFS mounted nolock, some FUSE ones) the directory goes without a lock,
// which a sweep cannot take either, so it is never swept.
func makeTempDir(log *slog.Logger) (dir string, lock *os.File, err error) {
	dir, err = os.MkdirTemp("", tempDirPrefix)
	if err != nil {
		return "", nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, tempDirLock+".new"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err == nil {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if errors.Is(err, syscall.ENOLCK) || errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
			log.Warn("the temporary directory's file system has no flock: a kill -9 of this up leaves its directory for good", "dir", dir, "err", err)
			err = nil
		}
		if err == nil {
			err = os.Rename(f.Name(), filepath.Join(dir, tempDirLock))
		}
		if err != nil {
			f.Close()
		}
	}
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	return dir, f, nil
}

// sweepTempDirs removes the directories of earlier Starts in tmp that no
// process holds any more: this user's, real directories (not links), with
// a lock file nobody holds. Such a directory is what a killed up left: its
// workers' files and TLS keys. Others are left alone, and a failure only
// costs the sweep.
func sweepTempDirs(tmp string, log *slog.Logger) {
	ents, err := os.ReadDir(tmp)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), tempDirPrefix) {
			continue
		}
		dir := filepath.Join(tmp, e.Name())
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() {
			continue
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Geteuid() {
			continue
		}
		// Not blocking (a FIFO of that name would hold the open), and
		// only a regular file counts.
		f, err := os.OpenFile(filepath.Join(dir, tempDirLock), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
		if err != nil {
			continue // no lock: not ours to judge (an older up's, or not up's)
		}
		if lfi, err := f.Stat(); err == nil && lfi.Mode().IsRegular() && syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			if err := os.RemoveAll(dir); err == nil {
				log.Info("removed what an up that did not stop left behind", "dir", dir)
			}
		}
		f.Close()
	}
}

// Startable reports why Start cannot start cl yet, or nil: a server group
// without instances (TensorRT-LLM's generation-only benchmark mode, or a
// cluster whose workers register themselves through disagg_cluster).
func Startable(cl *config.Cluster) error {
	for _, g := range []struct {
		name string
		g    *config.ServerGroup
	}{{"context_servers", &cl.Context}, {"generation_servers", &cl.Generation}} {
		if g.g.NumInstances > 0 {
			continue
		}
		if cl.DisaggCluster != nil {
			return fmt.Errorf("launch: %s has no instances to start: the file uses disagg_cluster, whose workers register themselves; "+
				"give the server groups num_instances for kvxfer up to start (they register themselves), or run kvxfer router and start the workers with kvxfer serve", g.name)
		}
		if g.name == "context_servers" {
			return fmt.Errorf("launch: context_servers.num_instances is 0, TensorRT-LLM's generation-only benchmark mode, " +
				"which kvxfer up does not support yet: a generation worker needs a context worker to prefill; set num_instances: 1 or more")
		}
		return fmt.Errorf("launch: generation_servers.num_instances is 0: there would be no worker to decode; set num_instances: 1 or more")
	}
	return nil
}

// defaults fills the unset options.
func (o *Options) defaults() error {
	if o.Model == "" {
		o.Model = serve.DefaultModel
	}
	if o.Ready == 0 {
		o.Ready = DefaultReady
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if len(o.Command) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		o.Command = []string{exe}
	}
	if len(o.Secret) == 0 {
		o.Secret = make([]byte, 32)
		rand.Read(o.Secret)
	}
	return nil
}

// start runs the phases of Start: TLS, workers, health, router.
func (l *Launched) start(ctx context.Context, o Options) error {
	tlsFiles, err := l.setupTLS(o)
	if err != nil {
		return err
	}
	var routerTLS *tlsconf.Config
	if rf, ok := tlsFiles["router"]; ok {
		if routerTLS, err = tlsconf.Load(rf); err != nil {
			return err
		}
	}
	l.client, l.scheme = serve.NewHTTPClient(nil), "http://"
	if routerTLS != nil {
		l.client, l.scheme = serve.NewHTTPClient(routerTLS.Client), "https://"
	}
	// The router's port first: taken, it fails Start before any worker
	// starts (and loads its model).
	if l.routerLn, err = listenRouter(o); err != nil {
		return err
	}
	// Then every worker's: a port given twice, taken, or on another host
	// fails Start before any worker starts too.
	if err := l.listenWorkers(o); err != nil {
		return err
	}
	if o.Cluster.DisaggCluster != nil {
		// The ranks of an MPI world (kvxfer serve-mpi) do not register:
		// the router, started first without static urls, would wait for
		// members that never come.
		if mpi, _, err := UsesMPI(o.Cluster, workerEnv(o.Env)); err == nil && mpi {
			return errors.New("launch: the workers' backend resolves to MPI, whose ranks do not register in a disagg_cluster: " +
				"remove disagg_cluster (kvxfer up gives the router the workers' urls), or choose another backend")
		}
		// The workers register themselves: the router (and for http://
		// its built-in store) comes first, the workers join it.
		if err := l.startRouter(o, routerTLS); err != nil {
			return err
		}
		if err := l.startWorkers(o, tlsFiles); err != nil {
			return err
		}
		if err := l.waitHealthy(ctx, o.Ready); err != nil {
			return err
		}
		return l.waitMembers(ctx, o.Ready)
	}
	if err := l.startWorkers(o, tlsFiles); err != nil {
		return err
	}
	if err := l.waitHealthy(ctx, o.Ready); err != nil {
		return err
	}
	return l.startRouter(o, routerTLS)
}

// openMembership opens the router's membership of a disagg_cluster: for
// http:// the built-in store the router serves (behind the cluster
// secret's token; kvxfer up always has a secret), for etcd:// a client.
// The workers' cluster_uri is the returned one: the router's own URL for
// the built-in store.
func (l *Launched) openMembership(ctx context.Context, o Options, routerURL string) (*serve.ClusterOptions, error) {
	dc := o.Cluster.DisaggCluster
	co := &serve.ClusterOptions{Name: dc.ClusterName, MinContext: dc.MinContext, MinGeneration: dc.MinGeneration, URI: dc.ClusterURI}
	if connect.IsBuiltIn(*dc) {
		st := memstore.New(memstore.Options{})
		l.endPolls = func() { st.Close() }
		l.closers = append(l.closers, l.endPolls)
		co.Store, co.Handler, co.URI = st, memstore.Handler(st, memstore.HandlerOptions{Token: connect.Token(o.Secret)}), routerURL
		l.clusterURI = routerURL
		return co, nil
	}
	st, err := connect.Open(ctx, *dc, connect.Options{EtcdClient: o.Cluster.Security.Etcd})
	if err != nil {
		return nil, fmt.Errorf("launch: disagg_cluster: %w", err)
	}
	l.closers = append(l.closers, func() { st.Close() })
	co.Store = st
	l.clusterURI = dc.ClusterURI
	return co, nil
}

// waitMembers waits until the router has every started worker as a member,
// by its URL: other records in the store (a stale one of an earlier run
// whose lease has not ended, another cluster's of the same name) are not
// the workers it started.
func (l *Launched) waitMembers(ctx context.Context, within time.Duration) error {
	deadline := time.Now().Add(within)
	poll := time.NewTicker(50 * time.Millisecond)
	defer poll.Stop()
	for {
		ci := l.router.ClusterInfo()
		missing := l.unregistered(ci)
		if len(missing) == 0 && ci.IsReady {
			return nil
		}
		// A worker that exits after it answered /health (its
		// registration failed, or it crashed) will not register.
		if err := l.exited("registered"); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			if len(missing) > 0 {
				return fmt.Errorf("launch: workers %s did not register within %v (the router's members: %s)", strings.Join(missing, ", "), within, memberURLs(ci))
			}
			return fmt.Errorf("launch: the workers did not all register within %v: %s", within, ci.Reason)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("launch: stopped while waiting for workers %s to register: %w", strings.Join(missing, ", "), context.Cause(ctx))
		case <-poll.C:
		}
	}
}

// unregistered returns the names of the started workers (of a role that
// registers) that the router does not have as members. A worker that
// listens on an unspecified address (0.0.0.0) advertises a host of its
// own choice: it is matched by its port.
func (l *Launched) unregistered(ci serve.ClusterInfo) []string {
	var missing []string
	for _, w := range l.workers {
		group := w.group()
		if group == "" {
			continue // the aggregated worker does not register
		}
		if !registered(w.url, ci.CurrentWorkers[group]) {
			missing = append(missing, w.name)
		}
	}
	return missing
}

// registered reports whether a registered worker of ws has url (or, for
// an unspecified host, its port).
func registered(url string, ws []serve.ClusterWorker) bool {
	hostPort := url[strings.Index(url, "://")+3:]
	host, port, _ := net.SplitHostPort(hostPort)
	anyHost := host == "" || net.ParseIP(host) != nil && net.ParseIP(host).IsUnspecified()
	for _, m := range ws {
		if m.Static {
			continue
		}
		if m.URL == url || anyHost && strconv.Itoa(m.Port) == port {
			return true
		}
	}
	return false
}

// memberURLs lists the registered workers of ci, for an error.
func memberURLs(ci serve.ClusterInfo) string {
	var us []string
	for _, g := range []string{"context_servers", "generation_servers"} {
		for _, m := range ci.CurrentWorkers[g] {
			if !m.Static {
				us = append(us, m.Role+" "+m.URL)
			}
		}
	}
	if len(us) == 0 {
		return "none"
	}
	return strings.Join(us, ", ")
}

// Wait returns nil when ctx ends, or an error once a server group has no
// worker left running: the router can serve nothing then (with a worker
// left it migrates to it). It logs every worker that exits on the way, with
// its exit and last lines; the error names the group's workers and their
// exits. It returns an error too once the router stops serving (its
// listener failed under it), since nothing can reach the workers then.
// The caller still calls Stop.
func (l *Launched) Wait(ctx context.Context) error {
	logged := map[*worker]bool{}
	for {
		if err := l.routerErr.Load(); err != nil {
			return fmt.Errorf("launch: the router stopped serving %s: %w", l.RouterURL, *err)
		}
		left := map[string]int{}
		gone := map[string][]string{}
		for _, w := range l.workers {
			group := w.group()
			if group == "" {
				continue // the aggregated worker of up --smoke: no group's
			}
			select {
			case <-w.p.done:
				if w.world {
					l.log.Error("mpirun exited", "pid", w.p.cmd.Process.Pid, "exit", w.exitError())
					return fmt.Errorf("launch: %s exited: %s", w.label(), w.exitError())
				}
				if !logged[w] {
					logged[w] = true
					l.log.Error("worker exited", "name", w.name, "pid", w.p.cmd.Process.Pid, "exit", w.exitError())
				}
				gone[group] = append(gone[group], w.name+": "+w.exitError())
			default:
				left[group]++
			}
		}
		for _, g := range []string{"context_servers", "generation_servers"} {
			if len(gone[g]) > 0 && left[g] == 0 {
				return fmt.Errorf("launch: %s has no worker left: %s", g, strings.Join(gone[g], "\n"))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-l.exits:
		}
	}
}

// group is the server group of w ("context_servers",
// "generation_servers"), or "" for the aggregated worker.
func (w *worker) group() string {
	switch {
	case strings.HasPrefix(w.name, serve.RoleContext+"-"):
		return "context_servers"
	case strings.HasPrefix(w.name, serve.RoleGeneration+"-"):
		return "generation_servers"
	}
	return ""
}

// exited returns an error naming the first worker that has exited before
// it did what, or nil.
func (l *Launched) exited(what string) error {
	for _, w := range l.workers {
		select {
		case <-w.p.done:
			return fmt.Errorf("launch: %s exited before it %s: %s", w.label(), what, w.exitError())
		default:
		}
	}
	return nil
}

// startWorkers starts the processes of every server group (and the
// aggregated worker when asked).
func (l *Launched) startWorkers(o Options, tlsFiles map[string]tlsconf.Files) error {
	cl := o.Cluster
	env := workerEnv(o.Env)
	mpi, reason, err := UsesMPI(cl, env)
	if err != nil {
		return err
	}
	if mpi {
		if err := l.startMPIWorkers(o, reason); err != nil {
			return err
		}
	}
	for _, g := range []struct {
		role string
		sg   *config.ServerGroup
		urls *[]string
	}{{serve.RoleContext, &cl.Context, &l.ContextURLs}, {serve.RoleGeneration, &cl.Generation, &l.GenerationURL}} {
		if ct := g.sg.CacheTransceiver; ct == nil || ct.Backend == config.BackendUnset {
			l.log.Info("the cluster file gives no cache_transceiver_config backend for this group: its workers get backend DEFAULT",
				"group", g.role, "backend", string(config.BackendDefault))
		}
		for i := range g.sg.NumInstances {
			if mpi {
				break
			}
			u, err := l.startWorker(o, tlsFiles, g.role, i, g.sg, g.sg.TensorParallelSize, g.sg.PipelineParallelSize)
			if err != nil {
				return err
			}
			*g.urls = append(*g.urls, u)
		}
	}
	if o.Aggregated {
		agg := cl.Generation
		agg.URLs = nil
		if mpi {
			// Outside the MPI world; it moves no KV cache.
			ct, err := config.NewCacheTransceiver(string(config.BackendTCP), agg.KVCache.TokensPerBlock, env)
			if err != nil {
				return err
			}
			agg.CacheTransceiver = ct
		}
		u, err := l.startWorker(o, tlsFiles, serve.RoleBoth, 0, &agg, 1, 1)
		if err != nil {
			return err
		}
		l.AggregatedURL = u
	}
	return nil
}

// listenWorkers opens the listener of every worker Start will start (into
// workerLns), or, for an MPI world, whose ranks bind their addresses
// themselves, checks that each address given can be bound. A port given
// twice, one taken (by another process, or by the router) and a host that
// is not this one's are each an error naming the urls entry.
func (l *Launched) listenWorkers(o Options) error {
	cl := o.Cluster
	groups := []struct {
		key, role string
		g         *config.ServerGroup
	}{{"context_servers", serve.RoleContext, &cl.Context}, {"generation_servers", serve.RoleGeneration, &cl.Generation}}
	seen := map[string]string{}
	for _, g := range groups {
		for i, u := range g.g.URLs {
			entry := fmt.Sprintf("%s.urls[%d]", g.key, i)
			addr := trimScheme(u)
			if prev, ok := seen[addr]; ok {
				return fmt.Errorf("launch: %s and %s are both %s: each worker needs a port of its own", prev, entry, addr)
			}
			seen[addr] = entry
		}
	}
	mpi, _, err := UsesMPI(cl, workerEnv(o.Env))
	if err != nil {
		return err
	}
	l.workerLns = map[string]*net.TCPListener{}
	for _, g := range groups {
		for i := range g.g.NumInstances {
			entry := fmt.Sprintf("%s instance %d", g.key, i)
			if i < len(g.g.URLs) {
				entry = fmt.Sprintf("%s.urls[%d]", g.key, i)
			} else if mpi {
				continue // a free port, chosen at the start (mpiInstanceAddr)
			}
			ln, err := groupListener(g.g, i)
			if err != nil {
				addr := ""
				if i < len(g.g.URLs) {
					addr = trimScheme(g.g.URLs[i])
				}
				return fmt.Errorf("%w%s", err, l.listenHint(err, entry, addr))
			}
			if mpi {
				ln.Close()
				continue
			}
			l.workerLns[fmt.Sprintf("%s-%d", g.role, i)] = ln
		}
	}
	if o.Aggregated {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("launch: listen for the aggregated worker: %w", err)
		}
		l.workerLns[serve.RoleBoth+"-0"] = ln.(*net.TCPListener)
	}
	return nil
}

// listenHint says why the listen on addr of entry (of the cluster file)
// failed, when it can.
func (l *Launched) listenHint(err error, entry, addr string) string {
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		if l.routerLn != nil {
			_, rp, _ := net.SplitHostPort(l.routerLn.Addr().String())
			if _, p, _ := net.SplitHostPort(addr); p == rp {
				return fmt.Sprintf(" (%s: the router's port)", entry)
			}
		}
		return fmt.Sprintf(" (%s: in use by another process)", entry)
	case errors.Is(err, syscall.EADDRNOTAVAIL):
		return fmt.Sprintf(" (%s: not an address of this host; kvxfer up starts every worker here: start the workers of other hosts with kvxfer serve there, and the router with kvxfer router)", entry)
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return fmt.Sprintf(" (%s: kvxfer up starts every worker on this host)", entry)
	}
	return ""
}

// trimScheme returns a urls entry without its http:// or https://.
func trimScheme(u string) string {
	return strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://")
}

// startWorker starts instance idx of a server group with role, TP tp and
// PP pp, and returns its URL.
func (l *Launched) startWorker(o Options, tlsFiles map[string]tlsconf.Files, role string, idx int, g *config.ServerGroup, tp, pp int) (string, error) {
	name := fmt.Sprintf("%s-%d", role, idx)
	ln := l.workerLns[name]
	if ln == nil {
		return "", fmt.Errorf("launch: no listener for %s (internal error)", name)
	}
	delete(l.workerLns, name)
	// The worker inherits the socket as fd 3; this process's copy closes
	// once the worker has started (or failed to).
	lf, err := ln.File()
	ln.Close()
	if err != nil {
		return "", fmt.Errorf("launch: listener of %s: %w", name, err)
	}
	defer lf.Close()
	addr := ln.Addr().String()
	cfgPath := filepath.Join(l.dir, name+".yaml")
	y := workerYAML(g, &o.Cluster.Security, tp, pp)
	if dc := o.Cluster.DisaggCluster; dc != nil && role != serve.RoleBoth {
		y = append(y, disaggYAML(dc, l.clusterURI)...)
	}
	if err := os.WriteFile(cfgPath, y, 0o600); err != nil {
		return "", err
	}
	host, port, _ := net.SplitHostPort(addr)
	args := append(append([]string{}, o.Command[1:]...), "serve", "--role", role, "--config", cfgPath,
		"--model", o.Model, "--host", host, "--port", port, "--listen-fd", "3")
	if f, ok := tlsFiles[name]; ok {
		args = append(args, "--tls-cert", f.CertFile, "--tls-key", f.KeyFile, "--tls-ca", f.CAFile)
	}
	cmd := exec.Command(o.Command[0], args...)
	cmd.ExtraFiles = []*os.File{lf}
	// The secret's variable comes last: it wins over one this process
	// inherited.
	cmd.Env = append(append(os.Environ(), o.Env...), config.EnvClusterSecret+"="+hex.EncodeToString(o.Secret))
	p, err := l.startProc(cmd, "["+name+"] ", o.Output)
	if err != nil {
		return "", fmt.Errorf("launch: start %s: %w", name, err)
	}
	w := &worker{name: name, url: l.scheme + addr, p: p}
	l.workers = append(l.workers, w)
	l.log.Info("worker started", "name", name, "pid", cmd.Process.Pid, "url", w.url)
	return w.url, nil
}

// startRouter starts the router in front of the workers and serves it on
// the cluster's (or the options') host and port.
func (l *Launched) startRouter(o Options, routerTLS *tlsconf.Config) error {
	cl := o.Cluster
	ln := l.routerLn
	l.routerLn = nil
	var err error
	if ln == nil {
		if ln, err = listenRouter(o); err != nil {
			return err
		}
	}
	l.RouterURL = "http://" + ln.Addr().String()
	ro := serve.ClusterRouting(cl)
	ro.Context, ro.Generation = l.ContextURLs, l.GenerationURL
	ro.Logger, ro.Client, ro.TLS, ro.RouterDeadlines, ro.MigrationLimit = l.log, l.client, tlsClient(routerTLS), o.Deadlines, o.MigrationLimit
	ro.Secret = o.Secret // the workers' reuse routes require it
	if cl.DisaggCluster != nil {
		if ro.Cluster, err = l.openMembership(context.Background(), o, l.RouterURL); err != nil {
			ln.Close()
			return err
		}
	}
	r, err := serve.NewRouter(ro)
	if err != nil {
		ln.Close()
		return err
	}
	l.router = r
	l.log.Info("listening", "plane", "router http", "addr", ln.Addr().String())
	l.ln = serve.LimitListener(ln, "router http", o.HTTP, l.log, metrics.NewConns(r.Registry()))
	l.server = serve.NewHTTPServer(r.Handler(), o.HTTP)
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		if err := l.server.Serve(l.ln); !errors.Is(err, http.ErrServerClosed) {
			// The listener failed under it: the workers run on, but
			// nothing reaches them. Wait ends kvxfer up on it.
			l.log.Error("router stopped serving", "addr", l.ln.Addr().String(), "err", err)
			l.routerErr.Store(&err)
			select {
			case l.exits <- struct{}{}:
			default:
			}
		}
	}()
	return nil
}

// listenRouter opens the router's listener on the options' (or the
// cluster's) host and port.
func listenRouter(o Options) (net.Listener, error) {
	host := o.Host
	if host == "" {
		host = o.Cluster.Hostname
	}
	port := o.Port
	if port == 0 {
		port = o.Cluster.Port
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(max(port, 0))))
	if err != nil {
		return nil, fmt.Errorf("launch: router listen: %w", err)
	}
	return ln, nil
}

// groupListener opens the HTTP listener of instance idx of a group: on its
// URL's address, or on a free loopback port. The launcher hands the open
// socket to the worker (see startWorker), so no other process can take the
// port between the choice and the worker's bind.
func groupListener(g *config.ServerGroup, idx int) (*net.TCPListener, error) {
	addr := "127.0.0.1:0"
	if idx < len(g.URLs) {
		addr = trimScheme(g.URLs[idx])
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("launch: listen on %s for instance %d: %w", addr, idx, err)
	}
	return ln.(*net.TCPListener), nil
}

// workerYAML writes the worker file of one server group, with the cluster's
// security block less where the secret is (the launcher hands the secret
// over in the environment). A group without a transceiver backend gets
// backend DEFAULT: the launcher starts its workers, so it must give them one.
func workerYAML(g *config.ServerGroup, sec *config.Security, tp, pp int) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "tensor_parallel_size: %d\npipeline_parallel_size: %d\n", tp, pp)
	fmt.Fprintf(&b, "kv_cache_config:\n  tokens_per_block: %d\n  max_tokens: %d\n", g.KVCache.TokensPerBlock, g.KVCache.MaxTokens)
	// The reuse keys as the cluster file set them (unset: the worker's
	// default, upstream's).
	for _, k := range []struct {
		key string
		v   *bool
	}{{"enable_block_reuse", g.KVCache.EnableBlockReuse}, {"enable_partial_reuse", g.KVCache.EnablePartialReuse}, {"copy_on_partial_reuse", g.KVCache.CopyOnPartialReuse}} {
		if k.v != nil {
			fmt.Fprintf(&b, "  %s: %t\n", k.key, *k.v)
		}
	}
	if g.KVCache.EventBufferMaxSize > 0 {
		fmt.Fprintf(&b, "  event_buffer_max_size: %d\n", g.KVCache.EventBufferMaxSize)
	}
	ct := g.CacheTransceiver
	if ct == nil || ct.Backend == config.BackendUnset {
		fmt.Fprintf(&b, "cache_transceiver_config:\n  backend: %s\n", config.BackendDefault)
	} else {
		fmt.Fprintf(&b, "cache_transceiver_config:\n  backend: %s\n  kv_transfer_timeout_ms: %d\n", ct.Backend, ct.KVTransferTimeoutMs)
		if ct.MaxTokensInBuffer > 0 {
			fmt.Fprintf(&b, "  max_tokens_in_buffer: %d\n", ct.MaxTokensInBuffer)
		}
		if ct.SenderFutureTimeoutMs > 0 {
			fmt.Fprintf(&b, "  kv_transfer_sender_future_timeout_ms: %d\n", ct.SenderFutureTimeoutMs)
		}
	}
	if len(sec.AllowedPeerHosts) > 0 || sec.TLS != (config.TLSFiles{}) || sec.Etcd != (config.EtcdClient{}) {
		b.WriteString("security:\n")
		if len(sec.AllowedPeerHosts) > 0 {
			fmt.Fprintf(&b, "  allowed_peer_hosts: %s\n", yamlFlowList(sec.AllowedPeerHosts))
		}
		if t := sec.TLS; t != (config.TLSFiles{}) {
			b.WriteString("  tls:\n")
			for _, kv := range [][2]string{{"cert_file", t.CertFile}, {"key_file", t.KeyFile}, {"ca_file", t.CAFile}} {
				if kv[1] != "" {
					fmt.Fprintf(&b, "    %s: %s\n", kv[0], strconv.Quote(kv[1]))
				}
			}
		}
		if e := sec.Etcd; e != (config.EtcdClient{}) {
			b.WriteString("  etcd:\n")
			for _, kv := range [][2]string{{"ca_file", e.CAFile}, {"cert_file", e.CertFile}, {"key_file", e.KeyFile},
				{"username", e.Username}, {"password_file", e.PasswordFile}} {
				if kv[1] != "" {
					fmt.Fprintf(&b, "    %s: %s\n", kv[0], strconv.Quote(kv[1]))
				}
			}
		}
	}
	return b.Bytes()
}

// disaggYAML is a worker file's disagg_cluster block: the cluster's, with
// uri as its cluster_uri.
func disaggYAML(dc *config.DisaggCluster, uri string) []byte {
	return fmt.Appendf(nil, "disagg_cluster:\n  cluster_uri: %s\n  cluster_name: %s\n  heartbeat_interval_sec: %d\n  inactive_timeout_sec: %d\n",
		strconv.Quote(uri), strconv.Quote(dc.ClusterName), dc.HeartbeatIntervalSec, dc.InactiveTimeoutSec)
}

// yamlFlowList writes strings as a YAML flow list of double-quoted strings
// (a JSON string is a valid YAML double-quoted scalar).
func yamlFlowList(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// setupTLS returns the TLS files of every worker (by name) and of the
// router ("router"), or none when TLS is off.
func (l *Launched) setupTLS(o Options) (map[string]tlsconf.Files, error) {
	cl := o.Cluster
	names := []string{"router"}
	for i := range cl.Context.NumInstances {
		names = append(names, fmt.Sprintf("context-%d", i))
	}
	for i := range cl.Generation.NumInstances {
		names = append(names, fmt.Sprintf("generation-%d", i))
	}
	if o.Aggregated {
		names = append(names, "both-0")
	}
	out := map[string]tlsconf.Files{}
	switch {
	case o.GenerateTLS:
		// Certificates for loopback and the hosts the workers listen on.
		var hosts []string
		for _, g := range []*config.ServerGroup{&cl.Context, &cl.Generation} {
			for _, u := range g.URLs {
				u = strings.TrimPrefix(strings.TrimPrefix(u, "http://"), "https://")
				if h, _, err := net.SplitHostPort(u); err == nil {
					hosts = append(hosts, h)
				}
			}
		}
		// Every certificate is issued now: the CA's key is never
		// written, so no file holds it while the cluster runs, nor
		// after a kill -9 of up.
		fs, err := tlsconf.WriteIssued(filepath.Join(l.dir, "tls"), names, hosts, 7*24*time.Hour)
		if err != nil {
			return nil, err
		}
		for i, n := range names {
			out[n] = fs[i]
		}
		l.log.Info("mutual TLS between the router and the workers, certificates made for this cluster", "dir", filepath.Join(l.dir, "tls"))
	case o.TLS.Enabled():
		if _, err := tlsconf.Load(o.TLS); err != nil {
			return nil, err
		}
		for _, n := range names {
			out[n] = o.TLS
		}
	}
	return out, nil
}

func tlsClient(c *tlsconf.Config) *tls.Config {
	if c == nil {
		return nil
	}
	return c.Client
}

// Client returns an HTTP client for the workers: with the router's
// certificate when TLS is on.
func (l *Launched) Client() *http.Client { return l.client }

func (l *Launched) waitHealthy(ctx context.Context, within time.Duration) error {
	deadline := time.Now().Add(within)
	client := &http.Client{Timeout: time.Second, Transport: l.client.Transport}
	retry := time.NewTimer(0)
	defer retry.Stop()
	for _, w := range l.workers {
		for !l.healthy(ctx, client, w) {
			// Any worker, not only the one waited for: one that died
			// while another loads is reported at once.
			if err := l.exited("was healthy"); err != nil {
				return err
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("launch: worker %s not healthy within %v%s", w.name, within, w.p.out.tailText())
			}
			retry.Reset(100 * time.Millisecond)
			select {
			case <-ctx.Done():
				return fmt.Errorf("launch: stopped while waiting for worker %s to answer /health: %w", w.name, context.Cause(ctx))
			case <-retry.C:
			}
		}
	}
	return nil
}

// healthy reports whether w answers its /health with 200.
func (l *Launched) healthy(ctx context.Context, client *http.Client, w *worker) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.url+"/health", nil)
	if err != nil {
		return false
	}
	resp, err := client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Stop stops the router, then every worker: SIGTERM, and SIGKILL for those
// still running 10 s later. It removes the generated worker files.
// Idempotent.
func (l *Launched) Stop() {
	l.stopped.Do(func() {
		if l.routerLn != nil { // opened, never served
			l.routerLn.Close()
		}
		for _, ln := range l.workerLns { // opened, never handed on
			ln.Close()
		}
		if l.server != nil {
			// The built-in store closes as the shutdown begins: a client
			// in one of its long polls would otherwise hold it.
			if l.endPolls != nil {
				l.server.RegisterOnShutdown(l.endPolls)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			l.server.Shutdown(ctx)
			cancel()
		}
		if l.router != nil {
			l.router.Close()
		}
		for _, c := range l.closers {
			c()
		}
		if l.client != nil {
			l.client.CloseIdleConnections()
		}
		for _, w := range l.workers {
			w.p.cmd.Process.Signal(syscall.SIGTERM)
		}
		grace, cancel := context.WithTimeout(context.Background(), stopGrace)
		defer cancel()
		for _, w := range l.workers {
			select {
			case <-w.p.done:
			case <-l.kill:
				l.Kill()
				<-w.p.done
			case <-grace.Done():
				l.log.Warn("worker did not stop, killing it", "name", w.name)
				w.p.kill()
				<-w.p.done
			}
		}
		l.wg.Wait()
		os.RemoveAll(l.dir)
		l.dirLock.Close()
	})
}

// Kill ends the cluster at once, for a second Ctrl-C while Stop waits for
// the workers: SIGKILL to every worker process (to mpirun for an MPI
// world) and the router's connections closed, so that Stop, running or to
// come, returns without its grace. Safe to call while Stop runs.
func (l *Launched) Kill() {
	for _, w := range l.workers {
		w.p.kill()
	}
	if l.server != nil {
		l.server.Close()
	}
}

// Workers returns the name and PID of every worker process.
func (l *Launched) Workers() map[string]int {
	out := map[string]int{}
	for _, w := range l.workers {
		out[w.name] = w.p.cmd.Process.Pid
	}
	return out
}

// Of a worker's log, an error carries the last tailLines lines, each cut
// at tailLineBytes.
const (
	tailLines     = 12
	tailLineBytes = 512
)

// prefixWriter prefixes every line written through it, and keeps the last
// tailLines lines for an error about the process that wrote them.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
	buf    []byte
	tail   []string // the last lines, oldest first
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
		p.line(p.buf[:i])
		p.buf = p.buf[i+1:]
	}
	if len(p.buf) > 64<<10 {
		p.line(p.buf)
		p.buf = p.buf[:0]
	}
	return len(b), nil
}

// line writes one complete line and keeps it in the tail.
func (p *prefixWriter) line(b []byte) {
	fmt.Fprintf(p.w, "%s%s\n", p.prefix, b)
	if len(p.tail) == tailLines {
		p.tail = append(p.tail[:0], p.tail[1:]...)
	}
	p.tail = append(p.tail, cutLine(b))
}

// cutLine returns b as a string of at most tailLineBytes.
func cutLine(b []byte) string {
	if len(b) > tailLineBytes {
		return string(b[:tailLineBytes]) + "..."
	}
	return string(b)
}

// tailText is the last lines written (with one not yet ended), indented
// under a heading, for an error; "" when nothing was written.
func (p *prefixWriter) tailText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	lines := p.tail
	if len(p.buf) > 0 {
		lines = append(lines[:len(lines):len(lines)], cutLine(p.buf))
	}
	if len(lines) == 0 {
		return ""
	}
	return "; its last lines:\n    " + strings.Join(lines, "\n    ")
}

// children returns the PIDs of pid's children (Linux's
// /proc/PID/task/*/children); none where that cannot be read.
func children(pid int) []int {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	var out []int
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, s := range strings.Fields(string(b)) {
			if k, err := strconv.Atoi(s); err == nil {
				out = append(out, k)
			}
		}
	}
	return out
}

// startTime is pid's start time (field 22 of /proc/PID/stat), or "" when
// it cannot be read: with the PID, it names one process.
func startTime(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	_, rest, ok := bytes.Cut(b, []byte(") "))
	if f := strings.Fields(string(rest)); ok && len(f) > 19 {
		return f[19]
	}
	return ""
}

// kill sends SIGKILL to p's children, then to p. OpenMPI puts each rank
// of a world in a process group of its own, so the ranks of a killed
// mpirun would run on, reparented to init (and hold p's output open, so
// that p.done never came). p's children are read only while p's PID still
// names p (its start time); a child keeps its PID until p reaps it.
func (p *proc) kill() {
	if st := startTime(p.cmd.Process.Pid); st != "" && st == p.started {
		for _, k := range children(p.cmd.Process.Pid) {
			syscall.Kill(k, syscall.SIGKILL)
		}
	}
	p.cmd.Process.Kill()
}
