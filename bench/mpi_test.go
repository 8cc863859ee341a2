package bench

import (
	"context"
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestMPIBTLAndLabel(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		ok       bool
	}{{"", MPIBTLVader, true}, {"vader", MPIBTLVader, true}, {"tcp", MPIBTLTCP, true}, {"sm", "", false}, {"openib", "", false}} {
		got, err := mpiBTL(tc.in)
		if got != tc.want || (err == nil) != tc.ok {
			t.Errorf("mpiBTL(%q) = %q, %v", tc.in, got, err)
		}
	}
	for _, tc := range []struct{ backend, btl, want string }{{"mpi", "vader", "mpi(vader)"}, {"mpi", "tcp", "mpi(tcp)"}, {"tcp", "vader", "tcp"}} {
		if got := mpiLabel(tc.backend, tc.btl); got != tc.want {
			t.Errorf("mpiLabel(%q, %q) = %q, want %q", tc.backend, tc.btl, got, tc.want)
		}
	}
	args := mpirunArgs("tcp", "/bin/x", "a")
	if i := slices.Index(args, "btl"); i < 0 || args[i+1] != "self,tcp" || !slices.Contains(args, "ob1") || !slices.Equal(args[len(args)-2:], []string{"/bin/x", "a"}) {
		t.Errorf("mpirunArgs: %v", args)
	}
	got := ratios(&Result{Backend: "mpi(vader)", GBps: 1}, []Baseline{{Name: BaselineMPI, GBps: 4}, {Name: BaselineUCXPerftest, GBps: 2}})
	if len(got) != 1 || got[0] != (Ratio{BaselineMPI, 0.25}) {
		t.Errorf("ratios of mpi(vader): %v", got)
	}
}

// TestMPIBaselineMissingTools: a machine without mpicc or mpirun gets the
// baseline skipped with the Debian package to install.
func TestMPIBaselineMissingTools(t *testing.T) {
	for _, missing := range []string{"mpicc", "mpirun"} {
		br := &baselineRunner{bytes: 1 << 20, timeout: time.Minute, lookPath: func(name string) (string, error) {
			if name == missing {
				return "", errors.New("not found")
			}
			return "/usr/bin/" + name, nil
		}}
		b := br.mpiBaseline(context.Background())
		want := map[string]string{"mpicc": "libopenmpi-dev", "mpirun": "openmpi-bin"}[missing]
		if b.GBps != 0 || !strings.Contains(b.Skipped, want) {
			t.Errorf("without %s: %+v, want skipped naming %s", missing, b, want)
		}
	}
}

// TestMPIBaseline builds and runs the C program over both components.
func TestMPIBaseline(t *testing.T) {
	for _, tool := range []string{"mpicc", "mpirun"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not installed", tool)
		}
	}
	for _, btl := range []string{MPIBTLVader, MPIBTLTCP} {
		// Two requests of 16 MiB: the baseline moves both.
		br := &baselineRunner{cfg: Config{Requests: 2}, bytes: 16 << 20, lookPath: exec.LookPath, timeout: time.Minute, mpiBTL: btl}
		b := br.mpiBaseline(context.Background())
		if b.Bytes < 32<<20 {
			t.Errorf("%s: baseline of %d bytes, want at least the run's 2 x 16 MiB", btl, b.Bytes)
		}
		if b.GBps <= 0 || b.Error != "" || len(b.Variants) != len(mpiBWSettings)*len(mpiBWPages) || !strings.Contains(b.Command, "self,"+btl) {
			t.Fatalf("%s: %+v", btl, b)
		}
		pages := map[string]int{}
		for _, v := range b.Variants {
			if v.GBps <= 0 || v.GBps > b.GBps || v.Bytes < 32<<20 {
				t.Errorf("%s: variant %+v, best %v", btl, v, b.GBps)
			}
			for _, p := range mpiBWPages {
				if strings.HasSuffix(v.Setting, ", "+p+" pages") && strings.HasSuffix(v.Command, " "+p) {
					pages[p]++
				}
			}
		}
		for _, p := range mpiBWPages {
			if pages[p] != len(mpiBWSettings) {
				t.Errorf("%s: %d variants on %s pages, want one per setting (%d): %+v", btl, pages[p], p, len(mpiBWSettings), b.Variants)
			}
		}
		t.Logf("%s: %.2f GB/s (%s)", btl, b.GBps, b.Best)
	}
}
