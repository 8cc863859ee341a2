package membershiptest

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
)

// EnvRequireEtcd, when set to anything but "" or "0", makes StartEtcd fail
// instead of skipping when no etcd binary is found.
const EnvRequireEtcd = "KVXFER_REQUIRE_ETCD"

// StartEtcd starts an etcd of its own for the test: a single member with
// its data in a temporary directory, on free loopback ports, killed (by
// its process) and waited for at the test's end. It returns the client
// address, host:port. Without an etcd binary on PATH it skips the test,
// saying why, unless EnvRequireEtcd is set.
func StartEtcd(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		if v := os.Getenv(EnvRequireEtcd); v != "" && v != "0" {
			t.Fatalf("no etcd binary on PATH and %s=%s: install Debian's etcd-server (apt-get install etcd-server)", EnvRequireEtcd, v)
		}
		t.Skipf("skipping: no etcd binary on PATH (install Debian's etcd-server; set %s=1 to make this a failure)", EnvRequireEtcd)
	}
	var last error
	for range 3 { // a free port can be taken between probing and binding
		addr, err := startEtcd(t, bin)
		if err == nil {
			return addr
		}
		last = err
	}
	t.Fatalf("etcd did not start: %v", last)
	return ""
}

func startEtcd(t testing.TB, bin string) (string, error) {
	dir := t.TempDir()
	cport, err := freeport.Port()
	if err != nil {
		return "", err
	}
	pport, err := freeport.Port()
	if err != nil {
		return "", err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(cport)
	peer := "http://127.0.0.1:" + strconv.Itoa(pport)
	logf, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return "", err
	}
	defer logf.Close()
	cmd := exec.Command(bin,
		"--name", "kvxfer-test",
		"--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "kvxfer-test="+peer,
		"--initial-cluster-state", "new",
		"--logger", "zap", "--log-outputs", "stderr",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return "", err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Kill()
		<-exited
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if ok := healthy(client); ok {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			stop()
			b, _ := os.ReadFile(logf.Name())
			return "", fmt.Errorf("etcd exited (%v): %s", err, tail(b, 2000))
		default:
		}
		if time.Now().After(deadline) {
			stop()
			b, _ := os.ReadFile(logf.Name())
			return "", fmt.Errorf("etcd not healthy after 15 s: %s", tail(b, 2000))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("etcd log (tail):\n%s", tail(b, 4000))
		}
	})
	return "127.0.0.1:" + strconv.Itoa(cport), nil
}

func healthy(client string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, client+"/health", nil)
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	r, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return false
	}
	defer r.Body.Close()
	var b [256]byte
	n, _ := r.Body.Read(b[:])
	return r.StatusCode == http.StatusOK && bytes.Contains(b[:n], []byte(`"true"`))
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}
