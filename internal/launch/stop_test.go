package launch

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

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
