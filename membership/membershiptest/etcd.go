package membershiptest

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/freeport"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
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
	return startEtcdRetry(t, nil)
}

// EtcdTLS is an etcd started by StartEtcdTLS: its client address and the
// PEM files of its test CA and of a client certificate that CA signed.
type EtcdTLS struct {
	Addr string
	// Client holds the client certificate, its key and the CA (which also
	// signed etcd's server certificate, for 127.0.0.1 and localhost).
	Client tlsconf.Files
	// Other is a certificate of another CA, which etcd refuses.
	Other tlsconf.Files
}

// StartEtcdTLS is StartEtcd for an etcd that serves its clients over TLS
// only and requires a client certificate signed by its CA
// (--client-cert-auth), as production etcd clusters are run.
func StartEtcdTLS(t testing.TB) EtcdTLS {
	t.Helper()
	dir := t.TempDir()
	fs, err := tlsconf.WriteCluster(filepath.Join(dir, "ca"), []string{"etcd", "client"}, nil, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	other, err := tlsconf.WriteCluster(filepath.Join(dir, "other"), []string{"client"}, nil, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	addr := startEtcdRetry(t, &fs[0])
	return EtcdTLS{Addr: addr, Client: fs[1], Other: other[0]}
}

func startEtcdRetry(t testing.TB, server *tlsconf.Files) string {
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
		addr, err := startEtcd(t, bin, server)
		if err == nil {
			return addr
		}
		last = err
	}
	t.Fatalf("etcd did not start: %v", last)
	return ""
}

// startEtcd starts one etcd; with server, its client URL is https with
// that certificate, and clients need a certificate of the same CA.
func startEtcd(t testing.TB, bin string, server *tlsconf.Files) (string, error) {
	dir := t.TempDir()
	cport, err := freeport.Port()
	if err != nil {
		return "", err
	}
	pport, err := freeport.Port()
	if err != nil {
		return "", err
	}
	scheme, tlsArgs, probe, err := etcdTLS(server)
	if err != nil {
		return "", err
	}
	client := scheme + "://127.0.0.1:" + strconv.Itoa(cport)
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
	cmd.Args = append(cmd.Args, tlsArgs...)
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
	if err := waitHealthy(client, probe, exited, stop, logf.Name()); err != nil {
		return "", err
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

// etcdTLS is the client URL scheme and etcd's TLS flags for server (plain
// HTTP when nil), and the TLS of the health probe.
func etcdTLS(server *tlsconf.Files) (scheme string, args []string, probe *tls.Config, err error) {
	if server == nil {
		return "http", nil, nil, nil
	}
	args = []string{"--cert-file", server.CertFile, "--key-file", server.KeyFile,
		"--trusted-ca-file", server.CAFile, "--client-cert-auth"}
	// The health probe presents etcd's own certificate (it is valid
	// for clients too).
	probe, err = tlsconf.LoadClient(server.CAFile, server.CertFile, server.KeyFile)
	if err != nil {
		return "", nil, nil, err
	}
	return "https", args, probe, nil
}

// waitHealthy waits up to 15 s for the etcd at client to answer its
// health check; when it exits first or never does, it is stopped and the
// error carries the tail of its log, logName.
func waitHealthy(client string, probe *tls.Config, exited chan error, stop func(), logName string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		if ok := healthy(client, probe); ok {
			return nil
		}
		select {
		case err := <-exited:
			exited <- err
			stop()
			b, _ := os.ReadFile(logName)
			return fmt.Errorf("etcd exited (%v): %s", err, tail(b, 2000))
		default:
		}
		if time.Now().After(deadline) {
			stop()
			b, _ := os.ReadFile(logName)
			return fmt.Errorf("etcd not healthy after 15 s: %s", tail(b, 2000))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func healthy(client string, tc *tls.Config) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, client+"/health", nil)
	tr := &http.Transport{DisableKeepAlives: true, TLSClientConfig: tc}
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
