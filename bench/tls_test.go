package bench

import (
	"bytes"
	"context"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseOpenSSLSpeed(t *testing.T) {
	for _, tc := range []struct {
		file  string
		block int
		kbps  float64
	}{
		{"openssl_3.0_speed.txt", 16384, 3690725.38},       // every block size
		{"openssl_3.0_speed_bytes.txt", 16384, 2868838.40}, // -bytes 16384
	} {
		out, err := os.ReadFile(filepath.Join("testdata", tc.file))
		if err != nil {
			t.Fatal(err)
		}
		block, gbps, err := parseOpenSSLSpeed(out)
		if want := tc.kbps * 1000 / 1e9; err != nil || block != tc.block || math.Abs(gbps-want) > 1e-9 {
			t.Errorf("%s: block %d, %v GB/s, %v; want %d, %v", tc.file, block, gbps, err, tc.block, want)
		}
	}
	for _, bad := range []string{
		"speed: Unknown option -bytes\n",
		"type 16 bytes 64 bytes\nAES-128-GCM 1.00k\n",      // a figure missing
		"type 16384 bytes\nAES-128-GCM lots\n",             // not a number
		"type 16384 bytes\nAES-256-GCM 2868838.40k\n",      // another cipher
		"type 16384 bytes\nAES-128-GCM      -1.00k\n",      // impossible
		"The 'numbers' are in 1000s of bytes per second\n", // no table
	} {
		if _, _, err := parseOpenSSLSpeed([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

// fakeOpenSSL writes an openssl that prints the canned speed table.
func fakeOpenSSL(t *testing.T) string {
	t.Helper()
	canned, err := filepath.Abs(filepath.Join("testdata", "openssl_3.0_speed_bytes.txt"))
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(t.TempDir(), "openssl")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\ncat '"+canned+"'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return exe
}

// TestTLSSweep: with TLS {false, true} every run is made plain and with
// mutual TLS, bit-exact both ways, the TLS one carried by tcp(tls); the
// cipher's limit is measured without --baseline, and only the TLS run is
// compared with it.
func TestTLSSweep(t *testing.T) {
	openssl := fakeOpenSSL(t)
	done := 0
	s := Sweep{
		Base:     peerCfg(Config{Model: "tiny", Requests: 2, Warmup: 1, Verify: true, CtxTP: 2}),
		Backends: []string{"tcp"},
		ISLs:     []int{128},
		TLS:      []bool{false, true},
		lookPath: func(name string) (string, error) {
			if name == "openssl" {
				return openssl, nil
			}
			return "", exec.ErrNotFound
		},
		Progress: func(e Event) {
			if e.Phase == PhaseDone {
				done++
			}
		},
	}
	rep, err := RunSweep(context.Background(), s)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Baselines) != 1 || rep.Baselines[0].Name != BaselineOpenSSL || math.Abs(rep.Baselines[0].GBps-2.8688384) > 1e-9 ||
		strings.Join(rep.Baselines[0].Backends, ",") != "tcp(tls)" || !strings.Contains(rep.Baselines[0].Command, "-evp aes-128-gcm") {
		t.Fatalf("baselines: %+v", rep.Baselines)
	}
	if len(rep.Runs) != 2 || done != 2 {
		t.Fatalf("%d runs, want 2", len(rep.Runs))
	}
	for i, r := range rep.Runs {
		wantTLS := i == 1
		wantBackend := map[bool]string{false: "tcp", true: "tcp(tls)"}[wantTLS]
		if !r.OK() || r.TLS != wantTLS || r.Backend != wantBackend || r.Verification != VerifyPassed {
			t.Errorf("run %d: %+v", i, r)
		}
		hasCipher := false
		for _, ra := range r.Ratios {
			hasCipher = hasCipher || ra.Baseline == BaselineOpenSSL
		}
		if hasCipher != wantTLS {
			t.Errorf("run %d (tls %v): ratios %+v", i, r.TLS, r.Ratios)
		}
	}
	var md, table bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	for _, out := range []string{md.String(), table.String()} {
		for _, want := range []string{"tcp+tls", "tcp(tls)", BaselineOpenSSL, "mutual TLS"} {
			if !strings.Contains(out, want) {
				t.Errorf("report lacks %q:\n%s", want, out)
			}
		}
	}
}

func TestRatiosTLS(t *testing.T) {
	bs := []Baseline{{Name: BaselineRawTCP, GBps: 2}, {Name: BaselineOpenSSL, GBps: 4}}
	got := ratios(&Result{Backend: "tcp(tls)", GBps: 1}, bs)
	if len(got) != 2 || got[0] != (Ratio{BaselineRawTCP, 0.5}) || got[1] != (Ratio{BaselineOpenSSL, 0.25}) {
		t.Errorf("tcp(tls): %v", got)
	}
	if got := ratios(&Result{Backend: "tcp", GBps: 1}, bs); len(got) != 1 {
		t.Errorf("tcp: %v, want raw_tcp only", got)
	}
}
