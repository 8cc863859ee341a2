package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/layout"
)

// The MPI backend moves data only between the ranks of one MPI world, so a
// run with backend mpi is not a child process of the bench: Run starts
// `mpirun -np 2 ... <this executable> bench mpi-rank`, and the command of
// each world rank calls MPIRankMain. Rank 0 is the generation side and
// runs the run as Run does (its Config comes in a job file); rank 1 is the
// context peer, answering the usual JSON lines (PeerMain) over a Unix
// socket that rank 0 listens on, since mpirun mixes the ranks' stdout. Rank
// 0 writes its Result to a file that Run reads once mpirun has exited.

// Components of OpenMPI's point-to-point layer a run can be pinned to
// (Config.MPIBTL): the bench passes --mca pml ob1 --mca btl self,BTL to
// mpirun, so that the transport named in the report is the one used.
const (
	MPIBTLVader = "vader" // shared memory, one host
	MPIBTLTCP   = "tcp"   // TCP sockets (loopback on one host)
)

// EnvMPIRunDir names the directory of a run's job, socket and result, set
// by Run for the ranks of its MPI world.
const EnvMPIRunDir = "KVXFER_BENCH_MPI_DIR"

// ErrMPIRank: MPIRankMain was called outside a world that Run started.
var ErrMPIRank = errors.New("bench: mpi rank")

// mpiJob is what rank 0 runs: the Config fields that make a run.
type mpiJob struct {
	Backend           string `json:"backend"`
	Model             string `json:"model"`
	ISL               int    `json:"isl"`
	Requests          int    `json:"requests"`
	Warmup            int    `json:"warmup"`
	Concurrency       int    `json:"concurrency"`
	CtxTP             int    `json:"ctx_tp"`
	CtxPP             int    `json:"ctx_pp"`
	GenTP             int    `json:"gen_tp"`
	GenPP             int    `json:"gen_pp"`
	MLA               bool   `json:"mla"`
	DType             string `json:"dtype"`
	TokensPerBlock    int    `json:"tokens_per_block"`
	MaxTokensInBuffer int    `json:"max_tokens_in_buffer"`
	Verify            bool   `json:"verify"`
	MPIBTL            string `json:"mpi_btl"`
}

// mpiResult is what rank 0 writes: its Result, and the latencies of its
// measured requests, which the rounds of a sweep pool (Result keeps them
// out of the report).
type mpiResult struct {
	Result      *Result   `json:"result"`
	LatenciesMs []float64 `json:"latencies_ms"`
}

func jobOf(c *Config) mpiJob {
	return mpiJob{Backend: c.Backend, Model: c.Model, ISL: c.ISL, Requests: c.Requests, Warmup: c.Warmup, Concurrency: c.Concurrency,
		CtxTP: c.CtxTP, CtxPP: c.CtxPP, GenTP: c.GenTP, GenPP: c.GenPP, MLA: c.MLA, DType: c.DType, TokensPerBlock: c.TokensPerBlock,
		MaxTokensInBuffer: c.MaxTokensInBuffer, Verify: c.Verify, MPIBTL: c.MPIBTL}
}

func (j mpiJob) config(env config.Env, log *slog.Logger) Config {
	return Config{Backend: j.Backend, Model: j.Model, ISL: j.ISL, Requests: j.Requests, Warmup: j.Warmup, Concurrency: j.Concurrency,
		CtxTP: j.CtxTP, CtxPP: j.CtxPP, GenTP: j.GenTP, GenPP: j.GenPP, MLA: j.MLA, DType: j.DType, TokensPerBlock: j.TokensPerBlock,
		MaxTokensInBuffer: j.MaxTokensInBuffer, Verify: j.Verify, MPIBTL: j.MPIBTL, Env: env, Logger: log}
}

// isMPI reports whether backend (as bench spells it) is MPI.
func isMPI(backend string) bool { return backend == config.BackendMPI.Lower() }

// mpiBTL is c's component, checked.
func mpiBTL(btl string) (string, error) {
	switch btl {
	case "", MPIBTLVader:
		return MPIBTLVader, nil
	case MPIBTLTCP:
		return MPIBTLTCP, nil
	}
	return "", fmt.Errorf("bench: --mpi-btl %q: want %s or %s", btl, MPIBTLVader, MPIBTLTCP)
}

// mpirunArgs is the mpirun command line of a world of two ranks running
// argv on the component btl: no binding (a Go process schedules its own
// threads), oversubscribed (the bench may run on fewer cores than ranks),
// and OpenMPI's ob1 point-to-point layer over btl (self for a rank to
// itself), so that OpenMPI cannot pick another transport (its UCX layer)
// behind the report's back.
func mpirunArgs(btl string, argv ...string) []string {
	return append([]string{"-np", "2", "--bind-to", "none", "--oversubscribe", "--mca", "pml", "ob1", "--mca", "btl", "self," + btl}, argv...)
}

// mpirunEnv is the environment of mpirun: this process's, with OpenMPI's
// own variables that let it run as root when it does, and extra.
func mpirunEnv(extra ...string) []string {
	env := os.Environ()
	if os.Getuid() == 0 {
		env = append(env, "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
	}
	return append(env, extra...)
}

// lookMPIRun finds mpirun, or says which package has it.
func lookMPIRun(lookPath func(string) (string, error)) (string, error) {
	exe, err := lookPath("mpirun")
	if err != nil {
		return "", fmt.Errorf("bench: backend mpi needs mpirun, which is not installed (Debian package openmpi-bin: apt-get install openmpi-bin; make deps installs it): %w", err)
	}
	return exe, nil
}

// mpiRankTimeout bounds how long one rank waits for the other to connect.
const mpiRankTimeout = time.Minute

// runMPIWorld runs c (backend mpi) as the two ranks of a world that mpirun
// starts, and returns rank 0's Result.
func runMPIWorld(ctx context.Context, c *Config) (*Result, error) {
	if c.ProcessPerRank {
		return nil, fmt.Errorf("bench: backend mpi with --process-per-rank: not supported (the MPI world has one process per instance)")
	}
	if c.TLS {
		return nil, fmt.Errorf("bench: backend mpi with TLS: not supported (MPI's data plane has no TLS)")
	}
	btl, err := mpiBTL(c.MPIBTL)
	if err != nil {
		return nil, err
	}
	c.MPIBTL = btl
	mpirun, err := lookMPIRun(exec.LookPath)
	if err != nil {
		return nil, err
	}
	argv := c.MPIRank
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("bench: backend mpi: %w", err)
		}
		argv = []string{exe, "bench", "mpi-rank"}
	}
	dir, err := os.MkdirTemp("", "kvxfer-bench-mpi-")
	if err != nil {
		return nil, fmt.Errorf("bench: backend mpi: %w", err)
	}
	defer os.RemoveAll(dir)
	job, _ := json.Marshal(jobOf(c))
	if err := os.WriteFile(filepath.Join(dir, "job.json"), job, 0o600); err != nil {
		return nil, fmt.Errorf("bench: backend mpi: %w", err)
	}
	cmd := exec.CommandContext(ctx, mpirun, mpirunArgs(btl, argv...)...)
	cmd.Env = mpirunEnv(EnvMPIRunDir + "=" + dir)
	out := &lockedWriter{}
	cmd.Stdout, cmd.Stderr = out, out
	// On cancel, SIGTERM: mpirun forwards it to the ranks and cleans up,
	// where SIGKILL would leave them running.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	runErr := cmd.Run()
	b, err := os.ReadFile(filepath.Join(dir, "result.json"))
	if err != nil {
		return nil, fmt.Errorf("bench: backend mpi: %s %s: no result from rank 0 (%v; mpirun: %v)\n%s",
			mpirun, strings.Join(mpirunArgs(btl, argv...), " "), err, runErr, tailString(out.String(), 2000))
	}
	var rr mpiResult
	if err := json.Unmarshal(b, &rr); err != nil || rr.Result == nil {
		return nil, fmt.Errorf("bench: backend mpi: rank 0's result %s: %v", filepath.Join(dir, "result.json"), err)
	}
	res := rr.Result
	res.lat = rr.LatenciesMs
	if runErr != nil {
		res.addError(fmt.Sprintf("mpirun: %v: %s", runErr, tailString(out.String(), 2000)))
	}
	return res, nil
}

func tailString(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// MPIRankMain is what rank rank of a world of size that Run started runs
// (`kvxfer bench mpi-rank`), once the command has initialised MPI: rank 0
// runs the job and writes its Result, rank 1 serves as its context peer.
// A run that fails is rank 0's Result with its error; MPIRankMain's error
// is for a rank that could not take part (the caller should then abort the
// world, so that the other rank does not wait).
func MPIRankMain(ctx context.Context, rank, size int, env config.Env, log *slog.Logger) error {
	dir := os.Getenv(EnvMPIRunDir)
	if dir == "" {
		return fmt.Errorf("%w: %s is not set: this command is started by kvxfer bench --backend mpi", ErrMPIRank, EnvMPIRunDir)
	}
	if size != 2 {
		return fmt.Errorf("%w: a world of %d ranks, want 2", ErrMPIRank, size)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	sock := filepath.Join(dir, "peer.sock")
	switch rank {
	case 0:
		b, err := os.ReadFile(filepath.Join(dir, "job.json"))
		if err != nil {
			return fmt.Errorf("%w 0: %w", ErrMPIRank, err)
		}
		var job mpiJob
		if err := json.Unmarshal(b, &job); err != nil {
			return fmt.Errorf("%w 0: job: %w", ErrMPIRank, err)
		}
		conn, err := acceptOne(sock)
		if err != nil {
			return fmt.Errorf("%w 0: %w", ErrMPIRank, err)
		}
		c := job.config(env, log)
		c.mpiPeer = conn
		res, err := Run(ctx, c)
		conn.Close()
		if res == nil {
			c.defaults()
			res = c.newResult()
			if c.Verify {
				res.Verification = VerifyNotRun
			}
		}
		if err != nil {
			res.fail(err)
		}
		out, _ := json.Marshal(mpiResult{Result: res, LatenciesMs: res.lat})
		if err := os.WriteFile(filepath.Join(dir, "result.json"), out, 0o600); err != nil {
			return fmt.Errorf("%w 0: result: %w", ErrMPIRank, err)
		}
		return nil
	case 1:
		conn, err := dialRetry(ctx, sock)
		if err != nil {
			return fmt.Errorf("%w 1: %w", ErrMPIRank, err)
		}
		defer conn.Close()
		return PeerMain(ctx, conn, conn, env, log)
	}
	return fmt.Errorf("%w: rank %d of a world of 2", ErrMPIRank, rank)
}

// acceptOne listens on the Unix socket path and accepts one connection,
// within mpiRankTimeout.
func acceptOne(path string) (net.Conn, error) {
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	defer ln.Close()
	ln.(*net.UnixListener).SetDeadline(time.Now().Add(mpiRankTimeout))
	conn, err := ln.Accept()
	if err != nil {
		return nil, fmt.Errorf("wait for the context rank on %s: %w", path, err)
	}
	return conn, nil
}

// dialRetry connects to the Unix socket path, which rank 0 may not have
// made yet, within mpiRankTimeout.
func dialRetry(ctx context.Context, path string) (net.Conn, error) {
	deadline := time.Now().Add(mpiRankTimeout)
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			return conn, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil, fmt.Errorf("connect to the generation rank on %s: %w", path, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// connPeer is the context peer of a run in an MPI world: rank 1, over conn.
// It sends setup, completed with the state cs, and waits for "ready".
func connPeer(conn net.Conn, setup peerSetup, cs *layout.CacheState) (*peerProc, error) {
	p := &peerProc{in: conn, out: bufio.NewScanner(conn), stderr: &lockedWriter{}, done: make(chan error, 1), name: "context rank (MPI world rank 1)"}
	p.out.Buffer(make([]byte, 1<<16), 1<<22)
	setup.State, _ = cs.MarshalBinary()
	line, _ := json.Marshal(setup)
	if _, err := fmt.Fprintf(conn, "%s\n", line); err != nil {
		p.stop()
		return nil, p.failed("send setup", err)
	}
	if err := p.waitReady(); err != nil {
		return nil, err
	}
	return p, nil
}

// mpiLabel is the backend that carried a run's data, with the component
// OpenMPI used: "mpi" becomes "mpi(vader)".
func mpiLabel(backend, btl string) string {
	if backend == "mpi" {
		return "mpi(" + btl + ")"
	}
	return backend
}
