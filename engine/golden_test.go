package engine

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/kvxfer/kvxfer/kvcache"
)

var update = flag.Bool("update", false, "rewrite testdata/golden.json")

// TestGolden pins the greedy tokens of every preset and KV dtype. Context
// and generation instances may run different builds: a change to the
// weights or the numerics must be deliberate (run with -update) and ship to
// both sides.
func TestGolden(t *testing.T) {
	got := map[string][]int32{}
	p := prompt("The golden prompt.")
	for _, name := range Presets() {
		for _, dt := range []kvcache.DType{kvcache.BF16, kvcache.FP8E4M3} {
			in := newTestInstance(t, name, InstanceConfig{TokensPerBlock: 16, DType: dt, PoolTokens: 64})
			got[name+"/"+dt.String()] = generate(t, in, p, 16, 0, 0).tokens
		}
	}
	path := filepath.Join("testdata", "golden.json")
	if *update {
		b, err := json.MarshalIndent(got, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	var want map[string][]int32
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("greedy tokens changed (-golden +got):\n%s", d)
	}
}
