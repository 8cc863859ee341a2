package cli

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/bench/benchtest"
)

// TestBenchCommandTLS runs `kvxfer bench --backend tcp --tls` as a user
// would: a plain and a TLS run, the cipher's limit measured by the
// installed openssl (or skipped with a note), a report that validates.
func TestBenchCommandTLS(t *testing.T) {
	t.Setenv("KVXFER_CLI_CHILD", "1") // bench starts this test binary as its context process (see TestMain)
	jsonPath := filepath.Join(t.TempDir(), "r.json")
	var stdout, stderr bytes.Buffer
	code := Run(context.Background(), []string{"bench", "--model", "tiny", "--isl", "256", "--backend", "tcp",
		"--requests", "2", "--warmup", "1", "--verify", "--tls", "--json", jsonPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit status %d\n%s\n%s", code, stdout.String(), stderr.String())
	}
	for _, want := range []string{"openssl_aes_128_gcm", "tcp+tls", "tcp(tls)"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, stdout.String())
		}
	}
	rep := benchtest.ReadReport(t, jsonPath)
	if len(rep.Runs) != 2 || rep.Runs[0].TLS || !rep.Runs[1].TLS || rep.Runs[1].Backend != "tcp(tls)" ||
		len(rep.Config.TLS) != 2 || len(rep.Baselines) != 1 {
		t.Fatalf("runs %+v %+v, config tls %v, baselines %+v", rep.Runs[0], rep.Runs[1], rep.Config.TLS, rep.Baselines)
	}
	b := rep.Baselines[0]
	if b.GBps > 0 {
		t.Logf("%s: %.2f GB/s; tcp %.2f GB/s, tcp+tls %.2f GB/s", b.Command, b.GBps, rep.Runs[0].GBps, rep.Runs[1].GBps)
	} else if b.Skipped == "" {
		t.Errorf("openssl baseline neither measured nor skipped: %+v", b)
	}
}
