package launch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/membership"
	"github.com/kvxfer/kvxfer/membership/connect"
)

// fakeWorkerEnv makes this test binary a fake worker when Start runs it
// (see fakeWorkerMain): its value is the fake's behaviour.
const fakeWorkerEnv = "KVXFER_LAUNCH_FAKE_WORKER"

// fakeWorkerMain is a worker that Start can run: it answers /health on the
// socket it inherits (fd 3) unless its mode is "silent", then, by mode, exits ("exit", 400 ms after its
// start) or registers a record of another URL than its own in the
// cluster's store and stays ("foreign"). It reports whether it ran.
func fakeWorkerMain() bool {
	mode := os.Getenv(fakeWorkerEnv)
	if mode == "" {
		return false
	}
	isCtx := false
	for i, a := range os.Args {
		if i+1 < len(os.Args) && a == "--role" {
			isCtx = os.Args[i+1] == "context"
		}
	}
	if mode == "loading-context" { // the context worker still loads, the generation worker dies
		if isCtx {
			select {}
		}
		os.Exit(4)
	}
	if mode == "stubborn" { // a worker that does not stop on SIGTERM (a long drain, a hung model)
		signal.Ignore(syscall.SIGTERM)
		ln, err := net.FileListener(os.NewFile(3, "listener"))
		if err != nil {
			os.Exit(2)
		}
		go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }))
		select {}
	}
	if mode == "stubborn-silent" { // a worker that loads for ever and does not stop on SIGTERM
		signal.Ignore(syscall.SIGTERM)
		select {}
	}
	if mode == "stuck" { // a worker whose load hangs, saying where
		fmt.Fprintln(os.Stderr, "fake worker: loading weights")
		fmt.Fprintln(os.Stderr, "fake worker: waiting for the GPU held by pid 4242")
		select {}
	}
	if mode == "silent" { // a worker still loading: it never answers
		select {}
	}
	if mode == "complain" { // a worker that refuses its command line, as serve does with --model bogus
		for i := range 30 {
			fmt.Fprintf(os.Stderr, "fake worker: loading line %d\n", i)
		}
		fmt.Fprint(os.Stderr, "fake worker: unknown model \"bogus\"\nfake worker: the last words, without a newline")
		os.Exit(2)
	}
	ln, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake worker:", err)
		os.Exit(2)
	}
	role, cfg := "", ""
	for i, a := range os.Args {
		if i+1 < len(os.Args) && a == "--role" {
			role = os.Args[i+1]
		}
		if i+1 < len(os.Args) && a == "--config" {
			cfg = os.Args[i+1]
		}
	}
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/crash" && mode == "crash-generation-0" && strings.HasSuffix(cfg, "generation-0.yaml") {
			fmt.Fprintln(os.Stderr, "fake worker: out of memory, crashing")
			os.Exit(5)
		}
		w.WriteHeader(http.StatusOK)
	}))
	switch mode {
	case "crash-generation-0": // generation-0 crashes when the test GETs its /crash
		select {}
	case "exit":
		time.Sleep(400 * time.Millisecond)
		os.Exit(3)
	case "foreign":
		f, err := config.LoadFile(cfg, config.LoadEnv(os.LookupEnv, os.Environ()))
		if err != nil || f.Worker == nil || f.Worker.DisaggCluster == nil {
			fmt.Fprintln(os.Stderr, "fake worker: config:", err)
			os.Exit(2)
		}
		dc := f.Worker.DisaggCluster
		secret, _, err := f.Worker.Security.LoadSecret(config.LoadEnv(os.LookupEnv, os.Environ()))
		if err != nil {
			os.Exit(2)
		}
		st, err := connect.Open(context.Background(), *dc, connect.Options{Token: connect.Token(secret)})
		if err != nil {
			os.Exit(2)
		}
		// Not this worker's URL: a record of another process (a stale one
		// of an earlier run, or another cluster's of the same name).
		other, _ := net.Listen("tcp", "127.0.0.1:0")
		rec := membership.Record{Role: membership.Role(role), URL: "http://" + other.Addr().String(), Model: "m",
			Layout: membership.Layout{TP: 1, PP: 1, DP: 1}, Incarnation: membership.NewIncarnation()}
		m, err := membership.NewMember(st, rec, connect.MemberOptions(*dc))
		if err == nil {
			err = m.Register(context.Background())
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake worker: register:", err)
			os.Exit(2)
		}
		select {}
	}
	os.Exit(2)
	return true
}

// startFakes runs Start on a disagg_cluster of one context and one
// generation worker, both fakes of mode, within ready.
func startFakes(t *testing.T, mode string, ready time.Duration) (*Launched, time.Duration, error) {
	t.Helper()
	cl := cluster(t, `hostname: 127.0.0.1
port: 8000
context_servers: {num_instances: 1}
generation_servers: {num_instances: 1}
disagg_cluster:
  cluster_uri: http://127.0.0.1:8000
  cluster_name: fakes
  heartbeat_interval_sec: 1
  inactive_timeout_sec: 3
`)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: ready,
		Env: []string{fakeWorkerEnv + "=" + mode}})
	took := time.Since(start)
	if l != nil {
		t.Cleanup(l.Stop)
	}
	return l, took, err
}

// TestWaitMembersWorkerExits: with disagg_cluster, a worker that exits
// after it answered /health but before it registered fails Start at once,
// naming the worker and its exit, instead of a wait for registrations
// that cannot come until the Ready bound.
func TestWaitMembersWorkerExits(t *testing.T) {
	_, took, err := startFakes(t, "exit", 20*time.Second)
	if err == nil || !strings.Contains(err.Error(), "exited") || !strings.Contains(err.Error(), "-0") {
		t.Fatalf("Start: %v, want an error naming the worker that exited", err)
	}
	if took > 10*time.Second {
		t.Errorf("Start failed after %v: it waited for registrations from a worker that had exited", took)
	}
	t.Logf("Start failed after %v: %v", took.Round(time.Millisecond), err)
}

// TestWaitMembersOwnURLs: Start waits for the workers it started, by
// URL, not for as many members as it started: records of other URLs (a
// stale one of an earlier run whose lease has not ended, another
// cluster's under the same name) do not make it report the cluster up
// while its own workers are not routable; the error names the workers
// that did not register.
func TestWaitMembersOwnURLs(t *testing.T) {
	_, took, err := startFakes(t, "foreign", 3*time.Second)
	if err == nil || !strings.Contains(err.Error(), "context-0") || !strings.Contains(err.Error(), "generation-0") {
		t.Fatalf("Start after %v: %v, want an error naming the workers that did not register", took, err)
	}
	t.Logf("Start failed after %v: %v", took.Round(time.Millisecond), err)
}

// TestStartMPIDisaggCluster: kvxfer up refuses at once a disagg_cluster
// whose workers would run in one MPI world: its ranks (kvxfer serve-mpi)
// do not register, so the router, started first with no static urls,
// would wait out the Ready bound for members that never come.
func TestStartMPIDisaggCluster(t *testing.T) {
	cl := cluster(t, `hostname: 127.0.0.1
port: 8000
context_servers: {num_instances: 1, cache_transceiver_config: {backend: MPI}}
generation_servers: {num_instances: 1, cache_transceiver_config: {backend: MPI}}
disagg_cluster:
  cluster_uri: http://127.0.0.1:8000
  cluster_name: mpi
`)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 10 * time.Second,
		Env: []string{fakeWorkerEnv + "=exit"}})
	if l != nil {
		l.Stop()
	}
	if err == nil || !strings.Contains(err.Error(), "MPI") || !strings.Contains(err.Error(), "disagg_cluster") {
		t.Fatalf("Start: %v, want a refusal naming MPI and disagg_cluster", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("refused after %v", took)
	}
}

// TestStartRouterPortTaken: kvxfer up whose router port is taken fails
// before it starts any worker, saying so, not after every worker started
// and became healthy (a large model's load).
func TestStartRouterPortTaken(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: port, Host: "127.0.0.1", Ready: 5 * time.Second,
		Env: []string{fakeWorkerEnv + "=silent"}})
	t.Logf("Start returned after %v", time.Since(start).Round(time.Millisecond))
	if l != nil {
		l.Stop()
	}
	if err == nil || !strings.Contains(err.Error(), "router listen") || !strings.Contains(err.Error(), fmt.Sprint(port)) {
		t.Fatalf("Start: %v, want the router's listen error on port %d", err, port)
	}
}

// TestStartWorkerDiesWhileAnotherLoads: a worker that exits while Start
// waits for another one to answer /health fails Start at once, naming it,
// not after the first one is healthy or the Ready bound.
func TestStartWorkerDiesWhileAnotherLoads(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 8 * time.Second,
		Env: []string{fakeWorkerEnv + "=loading-context"}})
	took := time.Since(start)
	if l != nil {
		l.Stop()
	}
	if err == nil || !strings.Contains(err.Error(), "generation-0 exited") {
		t.Fatalf("Start after %v: %v, want an error naming generation-0's exit", took, err)
	}
	if took > 4*time.Second {
		t.Errorf("Start failed after %v", took)
	}
}

// TestStartWorkerExitShowsLogTail: a worker that exits at start-up fails
// Start with an error that names it and carries the last lines it wrote,
// also when its log goes nowhere (kvxfer up --smoke and --quiet discard
// the workers' logs): "exit status 2" alone does not say why.
func TestStartWorkerExitShowsLogTail(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 8 * time.Second,
		Env: []string{fakeWorkerEnv + "=complain"}})
	if l != nil {
		l.Stop()
	}
	if err == nil {
		t.Fatal("Start succeeded with workers that exit at start-up")
	}
	msg := err.Error()
	for _, want := range []string{"-0 exited", "exit status 2", `fake worker: unknown model "bogus"`, "the last words, without a newline", "loading line 29"} {
		if !strings.Contains(msg, want) {
			t.Errorf("Start: %v\nwant it to contain %q", err, want)
		}
	}
	// A tail, not the whole log.
	if strings.Contains(msg, "loading line 0\n") {
		t.Errorf("Start's error carries the whole log, want its last lines:\n%v", err)
	}
}

// TestWaitWorkerLost: Wait, what kvxfer up runs on until its context ends,
// returns an error once a server group has no worker left, naming the
// worker and carrying its exit and last lines (else up would go on
// serving nothing but 502s and exit 0 at Ctrl-C, and systemd would
// never restart it); a group with workers left keeps the cluster up (the
// router migrates to them).
func TestWaitWorkerLost(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		generation int
		lost       bool
	}{{1, true}, {2, false}} {
		cl := cluster(t, fmt.Sprintf("hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: %d}\n", tc.generation))
		l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 8 * time.Second,
			Env: []string{fakeWorkerEnv + "=crash-generation-0"}})
		if err != nil {
			t.Fatal(err)
		}
		if resp, err := http.Get(l.GenerationURL[0] + "/crash"); err == nil {
			resp.Body.Close()
		}
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		start := time.Now()
		err = l.Wait(ctx)
		took := time.Since(start)
		ended := ctx.Err() != nil
		cancel()
		l.Stop()
		switch {
		case tc.lost && (err == nil || ended):
			t.Errorf("%d generation workers, generation-0 crashed: Wait returned %v after %v, want an error before its context ended", tc.generation, err, took)
		case tc.lost:
			for _, want := range []string{"generation", "generation-0", "exit status 5", "out of memory, crashing"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Wait: %v\nwant it to contain %q", err, want)
				}
			}
		case err != nil || !ended:
			t.Errorf("%d generation workers, generation-0 crashed: Wait returned %v after %v, want nil at the end of its context", tc.generation, err, took)
		}
		t.Logf("%d generation workers: Wait returned after %v: %v", tc.generation, took.Round(time.Millisecond), err)
	}
}

// TestWaitRouterStops: a router whose listener fails under it ends Wait
// with an error that names the router (before, its Serve's error was
// dropped: kvxfer up ran on with every worker healthy and nothing
// reaching them, and exited 0 at Ctrl-C).
func TestWaitRouterStops(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	var logs syncbuf.Buffer
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 8 * time.Second,
		Env: []string{fakeWorkerEnv + "=crash-generation-0"}, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Stop()
	l.ln.Close() // the listener's file gone from under the server
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	err = l.Wait(ctx)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("router listener closed: Wait returned %v (context ended: %v), want an error before its context ended", err, ctx.Err() != nil)
	}
	for _, want := range []string{"router stopped serving", l.RouterURL, "closed"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Wait: %v\nwant it to contain %q", err, want)
		}
	}
	if !strings.Contains(logs.String(), "router stopped serving") {
		t.Errorf("no log line of it:\n%s", logs.String())
	}
}

// TestKillWhileStopping: Kill, what kvxfer up does on a second Ctrl-C,
// ends workers that ignore the SIGTERM of Stop at once: Stop returns
// without waiting out its grace (10 s).
func TestKillWhileStopping(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 8 * time.Second,
		Env: []string{fakeWorkerEnv + "=stubborn"}})
	if err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	start := time.Now()
	go func() {
		l.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
		t.Fatal("Stop returned at once with workers that ignore SIGTERM")
	case <-time.After(300 * time.Millisecond):
	}
	l.Kill()
	select {
	case <-stopped:
	case <-time.After(stopGrace - time.Second):
		t.Fatalf("Stop still waits %v after Kill", stopGrace-time.Second)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("Stop returned %v after it began, Kill after 300 ms", took)
	}
	for name, pid := range l.Workers() {
		if err := syscall.Kill(pid, 0); err == nil {
			t.Errorf("worker %s (pid %d) still runs after Stop", name, pid)
		}
	}
}

// TestStartNotHealthyShowsLogTail: a worker that does not answer /health
// within the Ready bound fails Start with an error naming it and carrying
// its last lines, which say where its start-up hangs (kvxfer up --smoke
// and --quiet show no worker log).
func TestStartNotHealthyShowsLogTail(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	l, err := Start(t.Context(), Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 3 * time.Second,
		Env: []string{fakeWorkerEnv + "=stuck"}})
	took := time.Since(start)
	if l != nil {
		l.Stop()
	}
	if err == nil {
		t.Fatal("Start succeeded with workers that never answer")
	}
	for _, want := range []string{"context-0 not healthy within 3s", "waiting for the GPU held by pid 4242"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Start: %v\nwant it to contain %q", err, want)
		}
	}
	if took > 8*time.Second {
		t.Errorf("Start failed after %v, Ready 3 s", took)
	}
}

// TestWaitMPIWorldExit: the workers of an MPI world share one process,
// mpirun, which ends when any rank does: Wait says mpirun ended, with its
// last lines (which name the rank), not that context_servers (checked
// first) has no worker left when a generation rank died.
func TestWaitMPIWorldExit(t *testing.T) {
	l := &Launched{log: slog.New(slog.DiscardHandler), exits: make(chan struct{}, 1)}
	defer l.Stop()
	mpirun := exec.Command("sh", "-c", "sleep 0.2; echo 'mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).' >&2; exit 137")
	p, err := l.startProc(mpirun, "[mpi] ", nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"context-0", "generation-0"} {
		l.workers = append(l.workers, &worker{name: name, url: "http://127.0.0.1:1", p: p, world: true})
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	err = l.Wait(ctx)
	if err == nil {
		t.Fatal("Wait returned nil: it did not see mpirun end")
	}
	for _, want := range []string{"mpirun (the MPI world of every worker) exited", "exit status 137", "rank 1 with PID 0 on node vm exited on signal 9"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Wait: %v\nwant it to contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "context_servers") {
		t.Errorf("Wait: %v\nblames context_servers", err)
	}
	if err := l.exited("was healthy"); err == nil || !strings.Contains(err.Error(), "mpirun (the MPI world of every worker) exited before it was healthy") {
		t.Errorf("exited: %v, want it to name mpirun", err)
	}
}

// TestStartCanceledSaysWhere: Start whose context ends (kvxfer up's
// Ctrl-C while its workers load) returns at once with an error that says
// what it was waiting for, not a bare "context canceled".
func TestStartCanceledSaysWhere(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	l, err := Start(ctx, Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 20 * time.Second,
		Env: []string{fakeWorkerEnv + "=stuck"}})
	took := time.Since(start)
	if l != nil {
		l.Stop()
	}
	if err == nil || !strings.Contains(err.Error(), "stopped while waiting for worker context-0 to answer /health") ||
		!errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Start: %v, want it to say it stopped while waiting for context-0, wrapping the context's end", err)
	}
	if took > 4*time.Second {
		t.Errorf("Start returned %v after it began, its context ended at 500 ms", took)
	}
}

// TestKillOptionDuringStart: a second Ctrl-C while kvxfer up is still
// starting (Options.Kill) ends workers that ignore the SIGTERM of the
// failed Start's Stop at once. Before, nothing listened for it until
// Start had returned, after its Stop's 10 s grace.
func TestKillOptionDuringStart(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	kill := make(chan struct{})
	time.AfterFunc(300*time.Millisecond, cancel)
	time.AfterFunc(600*time.Millisecond, func() { close(kill) })
	start := time.Now()
	l, err := Start(ctx, Options{Cluster: cl, Command: []string{exe}, Port: -1, Host: "127.0.0.1", Ready: 30 * time.Second, Kill: kill,
		Env: []string{fakeWorkerEnv + "=stubborn-silent"}})
	took := time.Since(start)
	if err == nil {
		l.Stop()
		t.Fatal("Start succeeded with workers that never answer")
	}
	if took > stopGrace-2*time.Second {
		t.Errorf("Start returned %v after it began, Kill closed after 600 ms (its Stop's grace is %v)", took.Round(time.Millisecond), stopGrace)
	}
	t.Logf("Start returned after %v: %v", took.Round(time.Millisecond), err)
}
