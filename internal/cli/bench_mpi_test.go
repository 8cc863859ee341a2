package cli

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bench"
	"github.com/kvxfer/kvxfer/bench/benchtest"
)

// TestBenchMPI runs `kvxfer bench --backend mpi` as a user would: the two
// sides run as the ranks of one MPI world under the mpirun that bench
// starts (this test binary, with KVXFER_CLI_CHILD=1, is each rank's
// kvxfer), every byte verified; with --baseline the C MPI program is built
// and run in the same run, and the run is compared with it.
func TestBenchMPI(t *testing.T) {
	if mpiWorld == nil {
		t.Skip("needs the MPI backend: go test -tags mpi (make mpi)")
	}
	if _, err := exec.LookPath("mpirun"); err != nil {
		t.Fatalf("mpirun: %v (make deps installs openmpi-bin)", err)
	}
	t.Setenv("KVXFER_CLI_CHILD", "1")
	cases := []struct {
		name     string
		args     []string
		baseline bool
		used     string
		profile  bool // each rank writes its CPU profile
	}{
		{"verify", []string{"--verify"}, false, "mpi(vader)", false},
		{"tcp", []string{"--verify", "--mpi-btl", "tcp"}, false, "mpi(tcp)", true},
		{"baseline", []string{"--verify", "--baseline", "--baseline-bytes", "8388608"}, true, "mpi(vader)", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			profDir := t.TempDir()
			if c.profile {
				t.Setenv(envBenchMPIProfile, profDir)
				defer func() {
					for _, rank := range []string{"rank0.pprof", "rank1.pprof"} {
						if fi, err := os.Stat(filepath.Join(profDir, rank)); err != nil || fi.Size() == 0 {
							t.Errorf("%s: no CPU profile (%v)", rank, err)
						}
					}
				}()
			}
			jsonPath := filepath.Join(t.TempDir(), "r.json")
			var stdout, stderr bytes.Buffer
			args := append([]string{"bench", "--backend", "mpi", "--model", "tiny", "--isl", "256", "--requests", "3",
				"--warmup", "1", "--json", jsonPath}, c.args...)
			if code := Run(context.Background(), args, &stdout, &stderr); code != 0 {
				t.Fatalf("exit status %d\n%s\n%s", code, stdout.String(), stderr.String())
			}
			rep := benchtest.ReadReport(t, jsonPath)
			if len(rep.Runs) != 1 {
				t.Fatalf("%d runs, want 1", len(rep.Runs))
			}
			r := rep.Runs[0]
			if r.Backend != c.used || r.Verification != bench.VerifyPassed || !r.Verified || r.Errors != 0 ||
				r.Requests != 3 || r.BytesPerReq <= 0 || r.GBps <= 0 {
				t.Errorf("run %+v: want %d requests over %s, verified, no errors", r, 3, c.used)
			}
			if !strings.Contains(stdout.String(), c.used) {
				t.Errorf("the table does not name %s:\n%s", c.used, stdout.String())
			}
			var mpiC *bench.Baseline
			for i := range rep.Baselines {
				if rep.Baselines[i].Name == bench.BaselineMPI {
					mpiC = &rep.Baselines[i]
				}
			}
			if !c.baseline {
				if mpiC != nil || len(r.Ratios) != 0 {
					t.Errorf("no --baseline, yet baseline %+v, ratios %+v", mpiC, r.Ratios)
				}
				return
			}
			if mpiC == nil {
				t.Fatalf("no %s baseline in %+v", bench.BaselineMPI, rep.Baselines)
			}
			if mpiC.GBps <= 0 || mpiC.Best == "" || len(mpiC.Variants) < 2 || !strings.Contains(mpiC.Command, "--mca btl self,vader") {
				t.Errorf("baseline %+v: want a figure, the best of its variants, run over vader", *mpiC)
			}
			for _, v := range mpiC.Variants {
				if v.GBps <= 0 || v.Error != "" {
					t.Errorf("variant %+v failed", v)
				}
			}
			if len(r.Ratios) != 1 || r.Ratios[0].Baseline != bench.BaselineMPI || r.Ratios[0].Ratio != r.GBps/mpiC.GBps {
				t.Errorf("ratios %+v, want GB/s %v over %s's %v", r.Ratios, r.GBps, bench.BaselineMPI, mpiC.GBps)
			}
		})
	}
}

// TestBenchMPIErrors: the errors of a run with backend mpi that cannot
// start name what is missing.
func TestBenchMPIErrors(t *testing.T) {
	cases := []struct {
		name string
		args []string
		path string // PATH; "" keeps it
		want string
	}{
		{"bad btl", []string{"--mpi-btl", "openib"}, "", `--mpi-btl "openib": want vader or tcp`},
		{"no mpirun", nil, t.TempDir(), "openmpi-bin"},
	}
	if mpiWorld == nil {
		cases = []struct {
			name string
			args []string
			path string
			want string
		}{{"not built", nil, "", "not built in this binary: build with -tags mpi"}}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.path != "" {
				t.Setenv("PATH", c.path)
			}
			var stdout, stderr bytes.Buffer
			args := append([]string{"bench", "--backend", "mpi", "--model", "tiny", "--isl", "64", "--requests", "1"}, c.args...)
			code := Run(context.Background(), args, &stdout, &stderr)
			if code != 1 || !strings.Contains(stderr.String(), c.want) {
				t.Errorf("exit status %d, stderr does not say %q:\n%s", code, c.want, stderr.String())
			}
		})
	}
}

// TestBenchMPICancel: a run with backend mpi whose context ends stops its
// world (mpirun is sent SIGTERM and passes it to the ranks) and returns
// soon, not after the run.
func TestBenchMPICancel(t *testing.T) {
	if mpiWorld == nil {
		t.Skip("needs the MPI backend: go test -tags mpi (make mpi)")
	}
	t.Setenv("KVXFER_CLI_CHILD", "1")
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	start := time.Now()
	// About 400 requests of 32 MiB: far more than 1.5 s on any machine.
	c := bench.Config{Backend: "mpi", Model: "llama-3.1-8b", ISL: 256, Requests: 400, Warmup: 1}
	res, err := bench.Run(ctx, c)
	took := time.Since(start)
	if err == nil && (res == nil || res.Error == "" && res.Errors == 0) {
		t.Fatalf("a cancelled run reports no failure: %+v", res)
	}
	if took > 20*time.Second {
		t.Errorf("the cancelled run returned after %v", took)
	}
	t.Logf("returned after %v: %v %+v", took, err, res)
}
