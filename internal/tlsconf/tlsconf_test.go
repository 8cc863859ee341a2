package tlsconf

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// writeCluster writes a test cluster into a temporary directory.
func writeCluster(t *testing.T, names ...string) (string, []Files) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "certs")
	fs, err := WriteCluster(dir, names, []string{"10.1.2.3", "node1.example"}, time.Hour, false)
	if err != nil {
		t.Fatalf("WriteCluster: %v", err)
	}
	return dir, fs
}

// TestWriteIssued: the parties' files and the CA certificate, never the
// CA's key; each party's files load.
func TestWriteIssued(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	fs, err := WriteIssued(dir, []string{"router", "context-0"}, nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if len(names) != 5 || slices.Contains(names, CAKeyFileName) {
		t.Errorf("files %v, want the CA certificate and two parties' certificates and keys, no %s", names, CAKeyFileName)
	}
	for _, f := range fs {
		if _, err := Load(f); err != nil {
			t.Errorf("Load(%s): %v", f.CertFile, err)
		}
	}
}

func TestWriteClusterLoads(t *testing.T) {
	dir, fs := writeCluster(t, "ctx0", "gen0", "router")
	if len(fs) != 3 {
		t.Fatalf("got %d Files, want 3", len(fs))
	}
	for _, name := range []string{CAFileName, CAKeyFileName, "ctx0.pem", "ctx0-key.pem", "gen0.pem", "gen0-key.pem", "router.pem", "router-key.pem"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		want := os.FileMode(0o644)
		if strings.HasSuffix(name, "-key.pem") {
			want = 0o600
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	if fi, _ := os.Stat(dir); fi.Mode().Perm() != 0o700 {
		t.Errorf("directory mode %v, want 0700", fi.Mode().Perm())
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 8 {
		t.Errorf("%d files in the directory, want 8 (no temporary files left)", len(entries))
	}
	c, err := Load(fs[0])
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if c.Server.MinVersion != tls.VersionTLS13 || c.Client.MinVersion != tls.VersionTLS13 {
		t.Errorf("MinVersion = %x/%x, want TLS 1.3", c.Server.MinVersion, c.Client.MinVersion)
	}
	if c.Server.ClientAuth != tls.RequireAndVerifyClientCert {
		t.Errorf("ClientAuth = %v", c.Server.ClientAuth)
	}
	if c.Leaf.Subject.CommonName != "ctx0" {
		t.Errorf("CN = %q", c.Leaf.Subject.CommonName)
	}
	if d := time.Until(c.Leaf.NotAfter); d > time.Hour || d < 50*time.Minute {
		t.Errorf("validity ends in %v, want about an hour", d)
	}
	for _, h := range []string{"127.0.0.1", "::1", "localhost", "10.1.2.3", "node1.example"} {
		if err := c.Leaf.VerifyHostname(h); err != nil {
			t.Errorf("certificate does not cover %s: %v", h, err)
		}
	}
	if err := c.Leaf.VerifyHostname("10.9.9.9"); err == nil {
		t.Error("certificate covers 10.9.9.9, which was not asked for")
	}
	if _, err := WriteCluster(dir, []string{"ctx0"}, nil, time.Hour, false); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second WriteCluster without overwrite: %v, want already exists", err)
	}
	if _, err := WriteCluster(dir, []string{"ctx0"}, nil, time.Hour, true); err != nil {
		t.Errorf("WriteCluster with overwrite: %v", err)
	}
}

func TestWriteClusterNames(t *testing.T) {
	for _, names := range [][]string{{}, {"a", "a"}, {"ca"}, {"../x"}, {"a b"}, {".hidden"}, {"-flag"}} {
		if _, err := WriteCluster(t.TempDir(), names, nil, time.Hour, false); err == nil {
			t.Errorf("WriteCluster(%q) succeeded", names)
		}
	}
}

// handshake runs a TLS handshake between a server and a client config over
// loopback; it returns the server's and the client's error.
func handshake(t *testing.T, srv, cli *tls.Config, serverName string) (serr, cerr error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- err
			return
		}
		defer c.Close()
		tc := tls.Server(c, srv)
		tc.SetDeadline(time.Now().Add(5 * time.Second))
		if err := tc.Handshake(); err != nil {
			done <- err
			return
		}
		// TLS 1.3: the client's certificate is checked after the client
		// finished; a byte proves the connection is usable both ways.
		_, err = tc.Write([]byte{1})
		done <- err
	}()
	d := tls.Dialer{Config: cli}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr := ln.Addr().String()
	if serverName != "" {
		_, port, _ := net.SplitHostPort(addr)
		addr = net.JoinHostPort(serverName, port)
	}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err == nil {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		var b [1]byte
		_, err = c.Read(b[:])
		c.Close()
	}
	return <-done, err
}

func TestMutualHandshake(t *testing.T) {
	a, err := NewAuthority("test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := a.Party("srv", nil, time.Hour)
	cli, _ := a.Party("cli", nil, time.Hour)
	stranger, _ := other.Party("stranger", nil, time.Hour)
	noCert := cli.Client.Clone()
	noCert.Certificates = nil

	if serr, cerr := handshake(t, srv.Server, cli.Client, ""); serr != nil || cerr != nil {
		t.Fatalf("same CA: server %v, client %v", serr, cerr)
	}
	if serr, cerr := handshake(t, srv.Server, cli.Client, "localhost"); serr != nil || cerr != nil {
		t.Fatalf("same CA via localhost: server %v, client %v", serr, cerr)
	}
	cases := []struct {
		name      string
		cli       *tls.Config
		serverErr string // in the server's error
	}{
		{"client without a certificate", noCert, "certificate"},
		{"client certificate from another CA", stranger.Client, "certificate"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			serr, cerr := handshake(t, srv.Server, tc.cli, "")
			if serr == nil || !strings.Contains(serr.Error(), tc.serverErr) {
				t.Errorf("server: %v, want an error about the %s", serr, tc.serverErr)
			}
			if cerr == nil {
				t.Error("client: no error")
			}
		})
	}
	t.Run("server certificate from another CA", func(t *testing.T) {
		_, cerr := handshake(t, stranger.Server, cli.Client, "")
		var uerr x509.UnknownAuthorityError
		if cerr == nil || !errors.As(cerr, &uerr) {
			t.Errorf("client: %v, want x509.UnknownAuthorityError", cerr)
		}
	})
	t.Run("server name not in the certificate", func(t *testing.T) {
		c := cli.Client.Clone()
		c.ServerName = "elsewhere.example"
		_, cerr := handshake(t, srv.Server, c, "")
		var herr x509.HostnameError
		if cerr == nil || !errors.As(cerr, &herr) {
			t.Errorf("client: %v, want x509.HostnameError", cerr)
		}
	})
}

func TestLoadErrors(t *testing.T) {
	dir, fs := writeCluster(t, "a")
	_, other := writeCluster(t, "b")
	f := fs[0]
	write := func(name, data string) string {
		p := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, _ := NewAuthority("x", time.Hour)
	expiredCert, expiredKey, err := a.Issue("old", nil, -time.Minute/2)
	if err != nil {
		t.Fatal(err)
	}
	caPEM := write("ca.pem", string(a.CertPEM()))
	cases := []struct {
		name  string
		files Files
		want  string // in the error
	}{
		{"only a certificate", Files{CertFile: f.CertFile}, "[key CA]"},
		{"no CA", Files{CertFile: f.CertFile, KeyFile: f.KeyFile}, "[CA]"},
		{"missing CA file", Files{f.CertFile, f.KeyFile, filepath.Join(dir, "nope.pem")}, "CA file: open"},
		{"missing certificate file", Files{filepath.Join(dir, "nope.pem"), f.KeyFile, f.CAFile}, "certificate file: open"},
		{"CA file with garbage", Files{f.CertFile, f.KeyFile, write("junk.pem", "hello")}, "no PEM block"},
		{"key where the certificate should be", Files{f.KeyFile, f.KeyFile, f.CAFile}, `PEM blocks ["PRIVATE KEY"], none of them CERTIFICATE`},
		{"certificate where the key should be", Files{f.CertFile, f.CertFile, f.CAFile}, "none of them PRIVATE KEY"},
		{"CA file holding a leaf", Files{f.CertFile, f.KeyFile, f.CertFile}, "not a CA certificate"},
		{"key of another certificate", Files{f.CertFile, other[0].KeyFile, f.CAFile}, "private key does not match"},
		{"certificate of another CA", Files{other[0].CertFile, other[0].KeyFile, f.CAFile}, "is not signed by the CA in"},
		{"expired certificate", Files{write("old.pem", string(expiredCert)), write("old-key.pem", string(expiredKey)), caPEM}, "expired at"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Load(tc.files)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Load = %v, %v; want an error containing %q", c, err, tc.want)
			}
			if !strings.HasPrefix(err.Error(), "tlsconf: ") {
				t.Errorf("error %q lacks the package prefix", err)
			}
		})
	}
	if c, err := Load(Files{}); c != nil || err != nil {
		t.Errorf("Load(no files) = %v, %v; want nil, nil", c, err)
	}
	if _, err := Load(Files{CAFile: f.CAFile}); !errors.Is(err, ErrIncomplete) {
		t.Errorf("Load(CA only) = %v, want ErrIncomplete", err)
	}
}

// TestLoadClient: a client of a server outside the cluster trusts the CA
// file (or the system's roots), presents a certificate only when both its
// files are given, and gets the same errors as Load for bad files.
func TestLoadClient(t *testing.T) {
	dir, fs := writeCluster(t, "a")
	f := fs[0]
	c, err := LoadClient(f.CAFile, "", "")
	if err != nil || c.RootCAs == nil || len(c.Certificates) != 0 || c.MinVersion != tls.VersionTLS12 {
		t.Fatalf("CA only: %+v, %v", c, err)
	}
	if c, err = LoadClient("", "", ""); err != nil || c.RootCAs != nil {
		t.Fatalf("nothing: %+v, %v; want the system's roots", c, err)
	}
	if c, err = LoadClient(f.CAFile, f.CertFile, f.KeyFile); err != nil || len(c.Certificates) != 1 {
		t.Fatalf("with a client certificate: %+v, %v", c, err)
	}
	for _, tc := range []struct {
		name          string
		ca, cert, key string
		want          string
	}{
		{"certificate without key", f.CAFile, f.CertFile, "", "needs both"},
		{"key without certificate", f.CAFile, "", f.KeyFile, "needs both"},
		{"missing CA file", filepath.Join(dir, "nope.pem"), "", "", "CA file: open"},
		{"CA file holding a leaf", f.CertFile, "", "", "not a CA certificate"},
		{"certificate where the key should be", f.CAFile, f.CertFile, f.CertFile, "none of them PRIVATE KEY"},
	} {
		if _, err := LoadClient(tc.ca, tc.cert, tc.key); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}
