package chaos

import (
	"os/exec"
	"strings"
	"testing"
)

// TestFaultInjectionOnlyWithTag: kvxfer contains package faultinject (and
// so the data-plane faults of KVXFER_FAULTS) only when built with -tags chaos.
func TestFaultInjectionOnlyWithTag(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	const pkg = "github.com/kvxfer/kvxfer/transport/faultinject"
	for _, tc := range []struct {
		tags string
		want bool
	}{{"", false}, {"ucx", false}, {"chaos", true}} {
		out, err := exec.Command(goBin, "list", "-tags", tc.tags, "-deps", "../../cmd/kvxfer").CombinedOutput()
		if err != nil {
			t.Fatalf("go list -tags %q: %v\n%s", tc.tags, err, out)
		}
		if got := strings.Contains(string(out), pkg+"\n"); got != tc.want {
			t.Errorf("kvxfer built with -tags %q contains %s: %v, want %v", tc.tags, pkg, got, tc.want)
		}
	}
}
