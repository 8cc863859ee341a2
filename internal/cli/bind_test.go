package cli

import (
	"bufio"
	"encoding/json"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/procnet"
	"github.com/kvxfer/kvxfer/transport"
)

// TestServeBindsOnlyTheConfiguredHost starts `kvxfer serve` (this test
// binary, see TestMain) with every listener on 127.0.0.1 and checks, in the
// kernel's socket tables, that each TCP listener the process holds is bound
// to 127.0.0.1 and was logged at start. Issue #10: with AUTO or UCX, UCX
// used to listen on every interface whatever --transceiver-host said.
func TestServeBindsOnlyTheConfiguredHost(t *testing.T) {
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skip("needs Linux's /proc/net/tcp")
	}
	for _, backend := range []string{"AUTO", "TCP", "UCX"} {
		t.Run(backend, func(t *testing.T) {
			if st, _ := transport.Lookup(strings.ToLower(backend)); backend != "AUTO" && !st.Available() {
				t.Skipf("backend %s: %v", backend, st.Err)
			}
			pid, logged := startServe(t, backend, "--admin-addr", "127.0.0.1:0")
			ls, err := procnet.Listening(pid)
			if err != nil {
				t.Fatal(err)
			}
			if len(ls) < 4 { // HTTP, admin, 2 control listeners (TP2)
				t.Fatalf("the worker holds %d TCP listeners (%v), want at least 4", len(ls), ls)
			}
			want := netip.MustParseAddr("127.0.0.1")
			for _, l := range ls {
				if l.Addr.Addr() != want {
					t.Errorf("listener %v (inode %d) is not on %v", l.Addr, l.Inode, want)
				}
				if !logged.covers(l.Addr) {
					t.Errorf("listener %v was not logged at start (logged: %v)", l.Addr, logged)
				}
			}
		})
	}
}

// loggedListeners are the "listening" lines of a worker's log: exact
// addresses, and the hosts of backends whose ports their library picks.
type loggedListeners struct {
	addrs map[netip.AddrPort]bool
	hosts map[netip.Addr]bool
}

func (l loggedListeners) covers(a netip.AddrPort) bool { return l.addrs[a] || l.hosts[a.Addr()] }

// startServe runs a context worker (TP2, the given backend, and the flags
// extra) on 127.0.0.1 and returns its pid and the listeners it logged, once
// it serves HTTP.
func startServe(t *testing.T, backend string, extra ...string) (int, loggedListeners) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "worker.yaml")
	yaml := "tensor_parallel_size: 2\nkv_cache_config: {tokens_per_block: 16, max_tokens: 2048}\n" +
		"cache_transceiver_config: {backend: " + backend + "}\n"
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"serve", "--role", "context", "--config", cfg, "--host", "127.0.0.1", "--port", "0",
		"--transceiver-host", "127.0.0.1", "--log-format", "json"}, extra...)
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), "KVXFER_CLI_CHILD=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	})
	logged := loggedListeners{addrs: map[netip.AddrPort]bool{}, hosts: map[netip.Addr]bool{}}
	ready := make(chan error, 1)
	var lines []string
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			lines = append(lines, sc.Text())
			var rec struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &rec) != nil {
				continue
			}
			if rec.Msg == "listening" {
				// host:port, or for UCX (which picks its ports) the host
				// and its devices: "127.0.0.1 (lo)".
				if ap, err := netip.ParseAddrPort(rec.Addr); err == nil {
					logged.addrs[ap] = true
				} else if a, err := netip.ParseAddr(strings.Fields(rec.Addr + " ")[0]); err == nil {
					logged.hosts[a] = true
				}
			}
			if rec.Msg == "worker listening" {
				ready <- nil
				io.Copy(io.Discard, stderr)
				return
			}
		}
		ready <- io.ErrUnexpectedEOF
	}()
	select {
	case err := <-ready:
		if err != nil {
			cmd.Wait()
			t.Fatalf("the worker ended before it served:\n%s", strings.Join(lines, "\n"))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the worker did not start within 30 s")
	}
	return cmd.Process.Pid, logged
}
