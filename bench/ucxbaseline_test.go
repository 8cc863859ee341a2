package bench

import (
	"context"
	"errors"
	"math"
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestParseGBpsLine(t *testing.T) {
	for _, tc := range []struct {
		out  string
		want float64 // 0: an error
	}{
		{"gbps=10.5344 mean=10.3287 rounds=3 hugepages_kb=524288\n", 10.5344},
		{"some warning\n  gbps=2.5\n", 2.5},
		{"[1,0]<stdout>: noise\n  gbps=12.5  \nmore\n", 12.5}, // mpibw under mpirun
		{"gbps=1\ngbps=2\n", 1},                               // the first
		{"gbps=0 mean=0\n", 0},
		{"gbps=-1\n", 0},
		{"gbps=NaN\n", 0},
		{"gbps=+Inf\n", 0},
		{"gbps=\n", 0},
		{"ucxbw: ucp_init: Input/output error\n", 0},
		{"", 0},
	} {
		got, err := parseGBpsLine("ucxbw", []byte(tc.out))
		if tc.want == 0 {
			if err == nil || !strings.Contains(err.Error(), "ucxbw") {
				t.Errorf("%q: %v, %v; want an error naming ucxbw", tc.out, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %v, %v; want %v", tc.out, got, err, tc.want)
		}
	}
}

func TestUCXBWHugeKB(t *testing.T) {
	for _, tc := range []struct {
		out  string
		kb   int64
		okay bool
	}{
		{"gbps=1 best_round=2 rounds=8 hugepages_kb=524288\n", 524288, true},
		{"gbps=1 hugepages_kb=0\n", 0, true},
		{"gbps=1 hugepages_kb=-1\n", 0, false}, // smaps_rollup unreadable
		{"gbps=1 hugepages_kb=x\n", 0, false},
		{"gbps=1\n", 0, false},
	} {
		kb, ok := ucxBWHugeKB([]byte(tc.out))
		if ok != tc.okay || (ok && kb != tc.kb) {
			t.Errorf("%q: %d, %v; want %d, %v", tc.out, kb, ok, tc.kb, tc.okay)
		}
	}
}

func FuzzParseGBpsLine(f *testing.F) {
	f.Add([]byte("gbps=10.5 mean=9 rounds=8 hugepages_kb=0\n"))
	f.Add([]byte("gbps=1e400\n"))
	f.Add([]byte("x\ngbps=3"))
	f.Fuzz(func(t *testing.T, out []byte) {
		g, err := parseGBpsLine("p", out)
		if err == nil && (!(g > 0) || math.IsInf(g, 0)) {
			t.Fatalf("%q: %v accepted", out, g)
		}
		if err != nil && g != 0 {
			t.Fatalf("%q: %v with error %v", out, g, err)
		}
	})
}

// TestBuildC: a program that does not compile is an error naming the
// compiler's command and its complaint, and leaves no directory behind.
func TestBuildC(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("cc is not installed")
	}
	exe, cleanup, err := buildC(context.Background(), cc, "ok", "int main(void) { return 3; }\n")
	if err != nil {
		t.Fatal(err)
	}
	var ee *exec.ExitError
	if err := exec.Command(exe).Run(); !errors.As(err, &ee) || ee.ExitCode() != 3 {
		t.Errorf("built program: %v, want exit status 3", err)
	}
	cleanup()
	if _, err := exec.LookPath(exe); err == nil {
		t.Errorf("%s still there after cleanup", exe)
	}
	_, _, err = buildC(context.Background(), cc, "bad", "int main(void) { return undefined_name; }\n")
	if err == nil || !strings.Contains(err.Error(), "cc -O2 -o bad bad.c") || !strings.Contains(err.Error(), "undefined_name") {
		t.Errorf("broken source: %v", err)
	}
}

func TestUCXCBaselineWithoutCC(t *testing.T) {
	br := &baselineRunner{bytes: 1 << 20, timeout: time.Minute, lookPath: func(string) (string, error) { return "", exec.ErrNotFound }}
	if b := br.ucxC(context.Background()); b.GBps != 0 || !strings.Contains(b.Skipped, "gcc") {
		t.Errorf("without cc: %+v", b)
	}
}

// TestUCXCBaseline builds and runs the C program where cc and UCX's
// headers are installed: every setting measured on its span, the best
// being the baseline's figure.
func TestUCXCBaseline(t *testing.T) {
	if _, err := exec.LookPath("cc"); err != nil {
		t.Skip("cc is not installed")
	}
	if _, err := exec.LookPath("ucx_info"); err != nil {
		t.Skip("UCX is not installed")
	}
	t.Setenv("UCX_TLS", "tcp") // the same as a run with UCX_TLS=tcp; no shared memory needed
	br := &baselineRunner{bytes: 8 << 20, lookPath: exec.LookPath, timeout: time.Minute}
	b := br.ucxC(context.Background())
	// 8 MiB: two messages of 4 MiB, at most 8 in flight, is every one
	// in flight, and the 16 MiB setting is cut to the whole span: two
	// settings a page size, each measured once.
	if b.GBps <= 0 || b.Error != "" || len(b.Variants) != 4 || !strings.Contains(b.Description, "UCX_TLS=tcp") {
		t.Fatalf("%+v", b)
	}
	for _, v := range b.Variants {
		if v.GBps <= 0 || v.GBps > b.GBps || v.Bytes != ucxBWRounds*8<<20 || !strings.HasPrefix(v.Command, "ucxbw ") {
			t.Errorf("variant %+v, best %v", v, b.GBps)
		}
	}
	if b.Best == "" || !strings.Contains(b.Best, "pages") {
		t.Errorf("best %q", b.Best)
	}
	t.Logf("%.2f GB/s (%s)", b.GBps, b.Best)
}
