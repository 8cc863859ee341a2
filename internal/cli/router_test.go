package cli

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/serve"
)

// TestMigrationLimitFlag: kvxfer router and kvxfer up take
// --migration-limit, default 1, whose help says what it does; 0 turns
// migration off (serve.MigrationOff for the router's options).
func TestMigrationLimitFlag(t *testing.T) {
	for _, name := range []string{"router", "up"} {
		cmd, _, err := newRoot(env{lookup: func(string) (string, bool) { return "", false }}).Find([]string{name})
		if err != nil {
			t.Fatal(err)
		}
		f := cmd.Flags().Lookup("migration-limit")
		if f == nil {
			t.Fatalf("kvxfer %s has no --migration-limit", name)
		}
		if f.DefValue != "1" || !strings.Contains(f.Usage, "migrate") || !strings.Contains(f.Usage, "0 turns migration off") {
			t.Errorf("kvxfer %s --migration-limit: default %s, usage %q", name, f.DefValue, f.Usage)
		}
		if code, out, _ := runWith(t, nil, name, "--help"); code != 0 || !strings.Contains(out, "--migration-limit") {
			t.Errorf("kvxfer %s --help: %d, no --migration-limit in\n%s", name, code, out)
		}
	}
	for _, c := range []struct{ flag, want int }{{0, serve.MigrationOff}, {1, 1}, {4, 4}} {
		if got := migrationFlag(c.flag).limit(); got != c.want {
			t.Errorf("--migration-limit %d: RouterOptions.MigrationLimit %d, want %d", c.flag, got, c.want)
		}
	}
}
