package launch

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/membership/membershiptest"
	"github.com/kvxfer/kvxfer/membership/memstore"
)

// TestStopEndsStorePolls: kvxfer up's router serves the built-in store
// of a disagg_cluster; a client of the store in a long poll (a watcher)
// must not hold Stop. Before, Stop waited out the router's 5 s graceful
// shutdown, closing the store only after it.
func TestStopEndsStorePolls(t *testing.T) {
	st := memstore.New(memstore.Options{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: memstore.Handler(st, memstore.HandlerOptions{})}
	closeStore := func() { st.Close() }
	l := &Launched{server: srv, closers: []func(){closeStore}, endPolls: closeStore, log: slog.New(slog.DiscardHandler), dir: t.TempDir()}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(ln)
	}()
	cl, err := memstore.NewClient("http://"+ln.Addr().String(), memstore.ClientOptions{PollWait: memstore.MaxWait})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	polled := membershiptest.HoldPoll(t, cl)
	start := time.Now()
	l.Stop()
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("Stop took %v with a long poll of the built-in store held, want under 4 s (5 s before)", d.Round(10*time.Millisecond))
	}
	<-served
	select {
	case <-polled:
	case <-time.After(5 * time.Second):
		t.Error("the watcher's poll did not end within 5 s of Stop")
	}
}

// TestKillEndsChildren: killing a worker's process kills its children
// too. OpenMPI puts each rank of a world in a process group of its own, so
// a SIGKILL of mpirun (Kill, or Stop past its grace) left every rank
// running, holding its ports, reparented to init, and Stop waiting for
// mpirun's output, which the ranks held open. A shell whose two children
// leave its process group stands in for mpirun, and mpirun itself runs
// two ranks where it is installed.
func TestKillEndsChildren(t *testing.T) {
	worlds := map[string]func() *exec.Cmd{
		"stand-in": func() *exec.Cmd { return exec.Command("sh", "-c", "setsid sleep 300 & setsid sleep 300 & wait") },
	}
	if mpirun, err := exec.LookPath("mpirun"); err == nil {
		worlds["mpirun"] = func() *exec.Cmd {
			cmd := exec.Command(mpirun, mpirunArgs(2, 1, []string{"sleep"}, []string{"300"})...)
			cmd.Env = append(os.Environ(), MPIRootEnv...)
			return cmd
		}
	}
	for name, mk := range worlds {
		t.Run(name, func(t *testing.T) {
			l := &Launched{log: slog.New(slog.DiscardHandler), exits: make(chan struct{}, 1)}
			cmd := mk()
			p, err := l.startProc(cmd, "world", nil)
			if err != nil {
				t.Fatal(err)
			}
			var kids []int
			for deadline := time.Now().Add(10 * time.Second); len(kids) < 2; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					p.kill()
					<-p.done
					t.Fatalf("%s has %d children after 10 s, want 2", name, len(kids))
				}
				kids = children(cmd.Process.Pid)
			}
			p.kill()
			// p.done waits for the children too: they hold its output pipe.
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				var alive []int
				for _, k := range kids {
					if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", k)); err == nil && !strings.Contains(string(b), ") Z ") {
						alive = append(alive, k)
					}
				}
				if len(alive) == 0 {
					break
				}
				if time.Now().After(deadline) {
					for _, k := range alive {
						syscall.Kill(k, syscall.SIGKILL)
					}
					<-p.done
					t.Fatalf("children %v of a killed %s still run 5 s later", alive, name)
				}
			}
			<-p.done
			l.wg.Wait()
		})
	}
}

// TestSweepTempDirs: what a killed kvxfer up left in the temporary
// directory (its workers' files and TLS keys; SIGKILL runs no cleanup) is
// removed by the next Start, and nothing else is: not a running up's
// directory (its lock held, here by the test), not one without a lock
// file or whose lock is a FIFO (which must not hold the sweep), not a
// link, not a file.
func TestSweepTempDirs(t *testing.T) {
	tmp := t.TempDir()
	mk := func(name string, locked bool) string {
		t.Helper()
		dir := filepath.Join(tmp, name)
		if err := os.MkdirAll(filepath.Join(dir, "tls"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "tls", "context-0-key.pem"), []byte("key"), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Create(filepath.Join(dir, tempDirLock))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		if locked {
			if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	stale := mk(tempDirPrefix+"111", false)
	live := mk(tempDirPrefix+"222", true)
	noLock := filepath.Join(tmp, tempDirPrefix+"333")
	if err := os.Mkdir(noLock, 0o700); err != nil {
		t.Fatal(err)
	}
	target := mk("elsewhere", false)
	if err := os.Symlink(target, filepath.Join(tmp, tempDirPrefix+"444")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, tempDirPrefix+"555"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	fifoDir := filepath.Join(tmp, tempDirPrefix+"666")
	if err := os.Mkdir(fifoDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(fifoDir, tempDirLock), 0o600); err != nil {
		t.Fatal(err)
	}
	other := mk("unrelated", false)
	var logs syncbuf.Buffer
	sweepTempDirs(tmp, slog.New(slog.NewTextHandler(&logs, nil)))
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("the directory of an up that is gone is still there (%v)", err)
	}
	if !strings.Contains(logs.String(), stale) {
		t.Errorf("its removal is not logged:\n%s", logs.String())
	}
	for _, p := range []string{live, noLock, target, filepath.Join(tmp, tempDirPrefix+"444"), filepath.Join(tmp, tempDirPrefix+"555"), fifoDir, other} {
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s removed: %v", p, err)
		}
	}
}

// TestTempDirHeld: Start's directory (makeTempDir) holds its lock while
// the cluster runs, so a sweep by another Start leaves it; once its
// process is gone (the lock closed, as the kernel does at a kill -9), the
// next sweep removes it.
func TestTempDirHeld(t *testing.T) {
	t.Setenv("TMPDIR", t.TempDir())
	dir, lock, err := makeTempDir(slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(filepath.Base(dir), tempDirPrefix) {
		t.Errorf("%s: want the prefix %s", dir, tempDirPrefix)
	}
	sweepTempDirs(os.TempDir(), slog.New(slog.DiscardHandler))
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("a running cluster's directory was swept: %v", err)
	}
	lock.Close()
	sweepTempDirs(os.TempDir(), slog.New(slog.DiscardHandler))
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s left after its lock was released (%v)", dir, err)
	}
}

// TestGeneratedTLSKeepsNoCAKey: kvxfer up --tls issues every certificate
// at start and keeps no CA key on disk (one left after a kill -9 would let
// whoever reads it mint certificates this cluster's parties trust).
func TestGeneratedTLSKeepsNoCAKey(t *testing.T) {
	cl := cluster(t, "hostname: 127.0.0.1\nport: 8000\ncontext_servers: {num_instances: 1}\ngeneration_servers: {num_instances: 1}\n")
	l := &Launched{dir: t.TempDir(), log: slog.New(slog.DiscardHandler)}
	fs, err := l.setupTLS(Options{Cluster: cl, GenerateTLS: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(fs) != 3 {
		t.Errorf("%d parties' files, want 3 (router, context-0, generation-0)", len(fs))
	}
	for _, name := range []string{"ca.pem", "context-0-key.pem", "router.pem"} {
		if _, err := os.Stat(filepath.Join(l.dir, "tls", name)); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(l.dir, "tls", "ca-key.pem")); !os.IsNotExist(err) {
		t.Errorf("the CA key is on disk (%v)", err)
	}
}
