package config

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParsePeerHost(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{"10.0.0.5", "10.0.0.5", ""},
		{" 10.0.0.5 ", "10.0.0.5", ""},
		{"::FFFF:10.0.0.5", "10.0.0.5", ""},
		{"[fd00::7]", "fd00::7", ""},
		{"fd00:0:0::7", "fd00::7", ""},
		{"10.1.2.3/16", "10.1.0.0/16", ""},
		{"Ctx-A.Example", "ctx-a.example", ""},
		{"localhost", "localhost", ""},
		{"", "", "empty host"},
		{"10.0.0.5:8000", "", "without a port"},
		{"fe80::1%eth0", "", "zones"},
		{"10.0.0.0/40", "", "CIDR prefix"},
		{"-bad.example", "", "not a host name"},
		{"a b", "", "not a host name"},
		{strings.Repeat("a", 254), "", "not a host name"},
	} {
		got, err := ParsePeerHost(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParsePeerHost(%q) = %q, %v; want an error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParsePeerHost(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

// TestSecurityEnv: TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS is merged after the
// file's hosts, without duplicates, each entry with its source; the printed
// config keeps the env entries as comments so that it loads back to the same
// list.
func TestSecurityEnv(t *testing.T) {
	data := []byte("cache_transceiver_config:\n  backend: TCP\nsecurity:\n  allowed_peer_hosts: [10.0.0.5, ctx-a.example]\n")
	env := EnvFromMap(map[string]string{EnvAllowedPeerHosts: " 10.0.0.9, CTX-A.example,,10.0.0.5 ,10.2.0.0/16"})
	f, err := LoadBytes("w.yaml", data, env)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.5", "ctx-a.example", "10.0.0.9", "10.2.0.0/16"}
	if got := f.Worker.Security.AllowedPeerHosts; !slices.Equal(got, want) {
		t.Fatalf("AllowedPeerHosts = %q, want %q", got, want)
	}
	for path, src := range map[string]string{
		"security.allowed_peer_hosts[0]": "file w.yaml:4:24",
		"security.allowed_peer_hosts[1]": "file w.yaml:4:34",
		"security.allowed_peer_hosts[2]": "env " + EnvAllowedPeerHosts,
		"security.allowed_peer_hosts[3]": "env " + EnvAllowedPeerHosts,
	} {
		if got := f.Source(path).String(); got != src {
			t.Errorf("Source(%s) = %q, want %q", path, got, src)
		}
	}
	var b bytes.Buffer
	if err := f.Format(&b); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "# allowed peer hosts from env "+EnvAllowedPeerHosts+": 10.0.0.9, 10.2.0.0/16") {
		t.Errorf("printed config does not show the env hosts:\n%s", b.String())
	}
	f2, err := LoadBytes("printed.yaml", b.Bytes(), env)
	if err != nil {
		t.Fatalf("printed config does not load: %v\n%s", err, b.String())
	}
	if got := f2.Worker.Security.AllowedPeerHosts; !slices.Equal(got, want) {
		t.Errorf("after a round trip: %q, want %q", got, want)
	}

	// Without a security block the variable still applies, and for
	// workers started without a file too.
	f, err = LoadBytes("w.yaml", []byte("tensor_parallel_size: 1\n"), env)
	if err != nil || len(f.Worker.Security.AllowedPeerHosts) != 4 {
		t.Errorf("no block: %v %q", err, f.Worker.Security.AllowedPeerHosts)
	}
	s, err := SecurityFromEnv(env)
	if err != nil || len(s.AllowedPeerHosts) != 4 {
		t.Errorf("SecurityFromEnv: %v %q", err, s.AllowedPeerHosts)
	}
	// A cluster file's block has the same meaning.
	f, err = LoadBytes("c.yaml", []byte("context_servers: {cache_transceiver_config: {backend: TCP}}\ngeneration_servers: {cache_transceiver_config: {backend: TCP}}\nsecurity: {allowed_peer_hosts: [10.0.0.7]}\n"), env)
	if err != nil || !slices.Equal(f.Cluster.Security.AllowedPeerHosts, []string{"10.0.0.7", "10.0.0.9", "ctx-a.example", "10.0.0.5", "10.2.0.0/16"}) {
		t.Errorf("cluster: %v %q", err, f.Cluster.Security.AllowedPeerHosts)
	}

	bad := EnvFromMap(map[string]string{EnvAllowedPeerHosts: "10.0.0.5:80"})
	if _, err := LoadBytes("w.yaml", data, bad); err == nil || !strings.Contains(err.Error(), "env "+EnvAllowedPeerHosts+": \"10.0.0.5:80\": want a host without a port") {
		t.Errorf("bad env host: %v", err)
	}
	if _, err := SecurityFromEnv(bad); err == nil {
		t.Error("SecurityFromEnv accepted a bad host")
	}
}

func TestLoadSecret(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	hex64 := strings.Repeat("ab", 32)
	raw40 := strings.Repeat("s3cr3t-", 6)[:40]
	hexFile := write("hex", "  "+hex64+"\n", 0o600)
	rawFile := write("raw", raw40+"\n", 0o600)
	shortFile := write("short", strings.Repeat("ab", 31), 0o600)
	emptyFile := write("empty", " \n\t", 0o600)
	bigFile := write("big", strings.Repeat("x", maxSecretFile+1), 0o600)
	unreadable := write("unreadable", hex64, 0o000)
	vars := map[string]string{EnvClusterSecret: hex64, "MY_SECRET": raw40, "SHORT": "tiny"}
	env := EnvFromMap(vars)

	for _, tc := range []struct {
		name    string
		s       Security
		env     Env
		wantLen int
		source  string
		err     string
	}{
		{"file hex", Security{SecretFile: hexFile}, env, 32, "file " + hexFile, ""},
		{"file raw", Security{SecretFile: rawFile}, env, 40, "file " + rawFile, ""},
		{"file beats env", Security{SecretFile: rawFile}, env, 40, "file " + rawFile, ""},
		{"named env", Security{SecretEnv: "MY_SECRET"}, env, 40, "env MY_SECRET", ""},
		{"default env", Security{}, env, 32, "env " + EnvClusterSecret, ""},
		{"none", Security{}, Env{}, 0, "", ""},
		{"file too short", Security{SecretFile: shortFile}, env, 0, "file " + shortFile, "31 bytes (hex-decoded), at least 32"},
		{"file empty", Security{SecretFile: emptyFile}, env, 0, "file " + emptyFile, "empty"},
		{"file too big", Security{SecretFile: bigFile}, env, 0, "file " + bigFile, "larger than"},
		{"file missing", Security{SecretFile: filepath.Join(dir, "nope")}, env, 0, "file " + filepath.Join(dir, "nope"), "no such file"},
		{"named env unset", Security{SecretEnv: "UNSET_SECRET"}, env, 0, "env UNSET_SECRET", "UNSET_SECRET, which is not set"},
		{"named env too short", Security{SecretEnv: "SHORT"}, env, 0, "env SHORT", "4 bytes (raw)"},
	} {
		got, src, err := tc.s.LoadSecret(tc.env)
		if src != tc.source {
			t.Errorf("%s: source %q, want %q", tc.name, src, tc.source)
		}
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || got != nil {
				t.Errorf("%s: %d bytes, %v; want an error containing %q", tc.name, len(got), err, tc.err)
			}
			if err != nil && (strings.Contains(err.Error(), hex64) || strings.Contains(err.Error(), raw40)) {
				t.Errorf("%s: the error shows the secret: %v", tc.name, err)
			}
			continue
		}
		if err != nil || len(got) != tc.wantLen {
			t.Errorf("%s: %d bytes, %v; want %d bytes", tc.name, len(got), err, tc.wantLen)
		}
	}
	if _, _, err := (&Security{SecretEnv: "UNSET"}).LoadSecret(env); !errors.Is(err, ErrNoSecret) {
		t.Errorf("unset secret_env: %v, want ErrNoSecret", err)
	}
	if os.Geteuid() != 0 { // root reads anything
		if _, _, err := (&Security{SecretFile: unreadable}).LoadSecret(env); err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("unreadable file: %v", err)
		}
	}
	// The secret never enters the snapshot that reports print.
	for k, v := range LoadEnv(func(k string) (string, bool) { v, ok := vars[k]; return v, ok }, []string{EnvClusterSecret + "=" + hex64}).Raw {
		if strings.Contains(v, hex64) {
			t.Errorf("Env.Raw[%s] holds the secret", k)
		}
	}
}
