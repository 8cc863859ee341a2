package bench

import (
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// buildC compiles a baseline's C program, source, with compiler (cc,
// mpicc) and -O2 into a temporary directory, linking libs (such as
// "-lucp"). It returns the executable and a function that removes the
// directory. name names the program in its file names and errors.
func buildC(ctx context.Context, compiler, name, source string, libs ...string) (exe string, cleanup func(), err error) {
	dir, err := os.MkdirTemp("", "kvxfer-bench-"+name+"-")
	if err != nil {
		return "", nil, fmt.Errorf("bench: build %s: %w", name, err)
	}
	cleanup = func() { os.RemoveAll(dir) }
	src, exe := filepath.Join(dir, name+".c"), filepath.Join(dir, name)
	if err := os.WriteFile(src, []byte(source), 0o600); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("bench: build %s: %w", name, err)
	}
	args := append([]string{"-O2", "-o", exe, src}, libs...)
	if out, err := exec.CommandContext(ctx, compiler, args...).CombinedOutput(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("%s %s: %w: %s", filepath.Base(compiler), strings.Join(append([]string{"-O2", "-o", name, name + ".c"}, libs...), " "), err, tail(out))
	}
	return exe, cleanup, nil
}

// parseGBpsLine reads the "gbps=N" field of the first line of a C
// baseline's output that starts with it (other fields may follow, space
// separated); prog names the program in errors.
func parseGBpsLine(prog string, out []byte) (float64, error) {
	for line := range strings.Lines(string(out)) {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "gbps=")
		if !ok {
			continue
		}
		v, _, _ := strings.Cut(rest, " ")
		g, err := strconv.ParseFloat(v, 64)
		if err != nil || !(g > 0) || math.IsInf(g, 1) {
			return 0, fmt.Errorf("%s reported gbps=%q", prog, v)
		}
		return g, nil
	}
	return 0, fmt.Errorf("%s output has no gbps= line: %s", prog, tail(out))
}
