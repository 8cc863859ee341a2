package cli

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/procnet"
)

// TestHostileAdminListener: any process on the host is untrusted (README,
// Security). The admin listener serves net/http/pprof: the worker's
// goroutine stacks and command line, CPU profiles and execution traces, a
// garbage collection per ?gc=1 and a stop of the world per stack dump.
// Started without --admin-addr, a worker serves none of it on any of its
// TCP listeners; with --admin-addr unix:PATH it serves it on a socket of
// mode 0600 that refuses a process of another user even when the file's
// mode would let it connect.
func TestHostileAdminListener(t *testing.T) {
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skip("needs Linux's /proc/net/tcp")
	}
	t.Run("default", func(t *testing.T) {
		pid, _ := startServe(t, "TCP")
		noPprofOverTCP(t, pid)
	})
	t.Run("unix", func(t *testing.T) {
		dir := t.TempDir()
		sock := filepath.Join(dir, "admin.sock")
		pid, _ := startServe(t, "TCP", "--admin-addr", "unix:"+sock)
		fi, err := os.Lstat(sock)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
			t.Fatalf("admin socket %s: mode %v, want a socket of mode 0600", sock, fi.Mode())
		}
		if got := adminProbe(sock); !strings.HasPrefix(got, "answered: HTTP/1.0 200") {
			t.Fatalf("the worker's own user asked the admin socket for /debug/pprof/cmdline: %s", got)
		}
		noPprofOverTCP(t, pid)
		if os.Geteuid() != 0 {
			t.Log("not root: cannot run a client as another user; the socket's mode 0600 was checked")
			return
		}
		// Take the file's mode out of the way, so that the server's own
		// check of its peer's user is what is tested.
		bin := filepath.Join(t.TempDir(), "cli.test")
		copyExecutable(t, os.Args[0], bin)
		// (t.TempDir's folders, and the one that holds them, are 0700.)
		for _, p := range []string{filepath.Dir(dir), dir, filepath.Dir(bin)} {
			if err := os.Chmod(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(sock, 0o666); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "KVXFER_ADMIN_PROBE="+sock)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("the probe as user 65534: %v\n%s", err, out)
		}
		if !strings.HasPrefix(string(out), "refused") {
			t.Fatalf("a process of user 65534 asked the admin socket for /debug/pprof/cmdline: %s", out)
		}
	})
}

// noPprofOverTCP asks every TCP listener of process pid, at once, for
// /debug/pprof/cmdline, as any local process could, and fails the test for
// each that answers.
func noPprofOverTCP(t *testing.T, pid int) {
	t.Helper()
	ls, err := procnet.Listening(pid)
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) == 0 {
		t.Fatal("the worker holds no TCP listener")
	}
	client := &http.Client{Timeout: 2 * time.Second}
	var wg sync.WaitGroup
	for _, l := range ls {
		wg.Go(func() {
			resp, err := client.Get("http://" + l.Addr.String() + "/debug/pprof/cmdline")
			if err != nil {
				return
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
			if resp.StatusCode == http.StatusOK {
				t.Errorf("listener %v answered /debug/pprof/cmdline to a client that showed nothing: %s %q", l.Addr, resp.Status, body)
			}
		})
	}
	wg.Wait()
}

// adminProbe asks the admin socket at path for /debug/pprof/cmdline and
// says what came back: "answered: " and the status line, or "refused: "
// and why nothing did.
func adminProbe(path string) string {
	c, err := net.DialTimeout("unix", path, 5*time.Second)
	if err != nil {
		return "refused: " + err.Error()
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET /debug/pprof/cmdline HTTP/1.0\r\nHost: admin\r\n\r\n"); err != nil {
		return "refused: " + err.Error()
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return fmt.Sprintf("refused: %v (read %q)", err, line)
	}
	return "answered: " + strings.TrimSpace(line)
}

// copyExecutable copies the executable src to dst, mode 0755.
func copyExecutable(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
