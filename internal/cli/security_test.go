package cli

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/kvxfer/kvxfer/transceiver"
)

// TestConfigCheckSecurity: config check shows the security block with its
// sources and where the secret comes from and how long it is, never the
// secret.
func TestConfigCheckSecurity(t *testing.T) {
	dir := t.TempDir()
	secret := strings.Repeat("5a", 32)
	secretFile := filepath.Join(dir, "secret")
	os.WriteFile(secretFile, []byte(secret+"\n"), 0o600)
	withFile := filepath.Join(dir, "worker.yaml")
	os.WriteFile(withFile, []byte("cache_transceiver_config:\n  backend: TCP\nsecurity:\n  secret_file: "+secretFile+"\n  allowed_peer_hosts: [10.0.0.5]\n"), 0o644)
	plain := filepath.Join(dir, "plain.yaml")
	os.WriteFile(plain, []byte("cache_transceiver_config:\n  backend: TCP\n"), 0o644)
	missing := filepath.Join(dir, "missing.yaml")
	os.WriteFile(missing, []byte("cache_transceiver_config:\n  backend: TCP\nsecurity:\n  secret_file: "+filepath.Join(dir, "nope")+"\n"), 0o644)

	for _, tc := range []struct {
		name string
		vars map[string]string
		file string
		want []string
	}{
		{"secret file", map[string]string{config.EnvAllowedPeerHosts: "10.0.0.9"}, withFile, []string{
			"secret_file: " + secretFile + " # file " + withFile + ":4:16",
			"allowed_peer_hosts: [10.0.0.5] # file " + withFile,
			"# allowed peer hosts from env " + config.EnvAllowedPeerHosts + ": 10.0.0.9",
			"# security: cluster secret from file " + secretFile + " (32 bytes)",
		}},
		{"no secret", nil, plain, []string{"security: {} #", "# security: no cluster secret (" + config.EnvClusterSecret + " is unset)"}},
		{"secret from env", map[string]string{config.EnvClusterSecret: secret}, plain, []string{"# security: cluster secret from env " + config.EnvClusterSecret + " (32 bytes)"}},
		{"unreadable secret", nil, missing, []string{"# security: note: the cluster secret cannot be loaded here", "no such file"}},
	} {
		code, out, errw := runWith(t, tc.vars, "config", "check", tc.file)
		if code != 0 {
			t.Errorf("%s: exit %d\n%s%s", tc.name, code, out, errw)
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%s: output lacks %q:\n%s", tc.name, w, out)
			}
		}
		if strings.Contains(out+errw, secret) {
			t.Errorf("%s: config check printed the secret", tc.name)
		}
	}
}

// TestUpHandsOutSecret: `kvxfer up` gives every worker one generated secret
// in its environment only (not on its command line, not in its worker
// file), and the cluster then signs and checks its opaque states.
func TestUpHandsOutSecret(t *testing.T) {
	l := launchCluster(t, smallCluster, false)
	var secret string
	for name, pid := range l.Workers() {
		environ, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/environ")
		if err != nil {
			t.Skipf("cannot read a worker's environment: %v", err)
		}
		var got string
		for _, kv := range bytes.Split(environ, []byte{0}) {
			if v, ok := strings.CutPrefix(string(kv), config.EnvClusterSecret+"="); ok {
				got = v // the last one is the one in effect
			}
		}
		if b, err := hex.DecodeString(got); err != nil || len(b) != 32 {
			t.Fatalf("%s: %s is not 32 hex-encoded bytes (%d characters)", name, config.EnvClusterSecret, len(got))
		}
		if secret != "" && got != secret {
			t.Errorf("%s has another secret than its cluster", name)
		}
		secret = got
		cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		if bytes.Contains(cmdline, []byte(secret)) {
			t.Errorf("%s: the secret is on the command line", name)
		}
		args := strings.Split(string(cmdline), "\x00")
		for i, a := range args {
			if a == "--config" && i+1 < len(args) {
				fi, err := os.Stat(args[i+1])
				b, _ := os.ReadFile(args[i+1])
				if err != nil || fi.Mode().Perm()&0o077 != 0 || bytes.Contains(b, []byte(secret)) {
					t.Errorf("%s: worker file %s: %v, mode %v, holds the secret: %v", name, args[i+1], err, fi.Mode(), bytes.Contains(b, []byte(secret)))
				}
			}
		}
	}

	post := func(url string, body any) (int, string) {
		b, _ := json.Marshal(body)
		resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(raw)
	}
	code, raw := post(l.ContextURLs[0], map[string]any{"prompt": "sign me", "max_tokens": 4, "disaggregated_params": map[string]any{"request_type": "context_only"}})
	if code != 200 {
		t.Fatalf("context: %d %s", code, raw)
	}
	var c struct {
		Choices []struct {
			Disagg serve.DisaggregatedParams `json:"disaggregated_params"`
		} `json:"choices"`
		Prompt []int32 `json:"prompt_token_ids"`
	}
	json.Unmarshal([]byte(raw), &c)
	dp := c.Choices[0].Disagg
	opaque, _ := base64.StdEncoding.DecodeString(dp.EncodedOpaqueState)
	var op transceiver.OpaqueState
	if err := op.UnmarshalBinary(opaque); err != nil || !op.Signed {
		t.Fatalf("the context worker's state is not signed: %v", err)
	}
	dp.RequestType = serve.TypeGenerationOnly
	forged := bytes.Clone(opaque)
	forged[len(forged)-1] ^= 1
	fdp := dp
	fdp.EncodedOpaqueState = base64.StdEncoding.EncodeToString(forged)
	if code, raw := post(l.GenerationURL[0], map[string]any{"prompt": c.Prompt, "max_tokens": 4, "disaggregated_params": fdp}); code != http.StatusForbidden || !strings.Contains(raw, "opaque_state_forged") {
		t.Errorf("forged state: %d %s", code, raw)
	}
	if code, raw := post(l.GenerationURL[0], map[string]any{"prompt": c.Prompt, "max_tokens": 4, "disaggregated_params": dp}); code != 200 {
		t.Errorf("genuine state: %d %s", code, raw)
	}
}
