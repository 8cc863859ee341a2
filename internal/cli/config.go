package cli

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/spf13/cobra"
)

func newConfigCmd(e env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Work with kvxfer / TensorRT-LLM config files",
	}
	var strict bool
	check := &cobra.Command{
		Use:   "check FILE|DIR...",
		Short: "Validate worker and cluster config files and print the effective config with each value's source",
		Long: `check loads each FILE in the order defaults -> YAML -> environment -> validation and
prints the effective configuration, where every value came from (default, file:line:col,
the cluster file's top level, env), the backend that DEFAULT resolves to and why, the
settings that are accepted but not applied, every warning and every error.
A file with context_servers or generation_servers is a cluster file (disagg_config.yaml);
any other is a worker file (extra LLM API options).

For a DIR, check loads every *.yaml and *.yml file under it and prints one line per file:
valid, valid with warnings, or invalid. Exit status 0 when every file is valid, 1 otherwise;
with --strict, a warning makes a file invalid too.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			envSnap := config.LoadEnv(e.lookup, e.environ)
			out, errw := cmd.OutOrStdout(), cmd.ErrOrStderr()
			bad := 0
			for i, path := range args {
				if i > 0 {
					fmt.Fprintln(out)
				}
				if fi, err := os.Stat(path); err == nil && fi.IsDir() {
					bad += checkDir(out, errw, path, envSnap, strict)
					continue
				}
				c := checkFile(path, envSnap)
				c.print(out, errw)
				if !c.ok(strict) {
					bad++
				}
			}
			if bad > 0 {
				return exitError{1}
			}
			return nil
		},
	}
	check.Flags().BoolVar(&strict, "strict", false, "treat every warning as an error")
	cmd.AddCommand(check)
	return cmd
}

// checked is the check of one file.
type checked struct {
	path string
	env  config.Env
	f    *config.File // nil when the file could not be read as YAML
	err  error
	// warnings are the loader's and those of each backend's resolution,
	// formatted; notApplied are those about settings that are accepted but
	// have no effect.
	warnings, notApplied []string
	// kinds counts the warnings by config.Problem.Kind.
	kinds map[string]int
	// resolutions say what each configured backend resolves to and why.
	resolutions []string
}

func checkFile(path string, env config.Env) *checked {
	c := &checked{path: path, env: env, kinds: map[string]int{}}
	c.f, c.err = config.LoadFile(path, env)
	if c.f == nil {
		return c
	}
	for _, nt := range c.f.Transceivers() {
		r := nt.CT.Resolve(transceiver.Availability)
		switch {
		case r.Configured == "" && c.err != nil:
			// The file's own error says what is wrong with the backend
			// (an unknown name loads as none): "not set" would mislead.
			continue
		case r.Configured == "":
			c.resolutions = append(c.resolutions, fmt.Sprintf("# %s: not set: no transceiver, disaggregated requests are refused", nt.Path+".backend"))
		default:
			c.resolutions = append(c.resolutions, fmt.Sprintf("# %s: %s → %s: %s", nt.Path+".backend", r.Configured, r.Backend, r.Reason))
		}
		for _, ig := range r.Ignored {
			c.resolutions = append(c.resolutions, "#   env "+ig)
		}
		if r.Err != nil && c.err == nil {
			// A valid config whose backend this binary cannot run (UCX
			// without -tags ucx, say) is the binary's problem, not the
			// file's: say so, but do not fail the check.
			c.resolutions = append(c.resolutions, fmt.Sprintf("#   note: in this binary: %v", r.Err))
		}
		if r.Warning != "" {
			c.warnings = append(c.warnings, fmt.Sprintf("%s: %s.backend: %s", path, nt.Path, r.Warning))
			c.kinds[""]++
		}
	}
	for _, w := range c.f.Warnings {
		c.warnings = append(c.warnings, w.String())
		c.kinds[w.Kind]++
		if w.Kind == config.KindNotApplied {
			c.notApplied = append(c.notApplied, w.String())
		}
	}
	return c
}

// ok reports whether the file is valid: it loaded, and with strict it has
// no warning either.
func (c *checked) ok(strict bool) bool { return c.err == nil && (!strict || len(c.warnings) == 0) }

// print writes the full report of the file: the effective config on out,
// warnings and errors on errw.
func (c *checked) print(out, errw io.Writer) {
	if c.f == nil {
		fmt.Fprintf(out, "# %s: invalid\n", c.path)
		printErrors(errw, c.err)
		return
	}
	status := "valid"
	if c.err != nil {
		status = "invalid"
	}
	fmt.Fprintf(out, "# %s: %s file, %s\n", c.path, c.f.Kind, status)
	if ferr := c.f.Format(out); ferr != nil {
		fmt.Fprintf(errw, "error: %v\n", ferr)
		return
	}
	for _, r := range c.resolutions {
		fmt.Fprintln(out, r)
	}
	printSecret(out, c.f, c.env)
	if c.f.Kind == config.KindWorker && c.f.Worker.CacheTransceiver == nil {
		fmt.Fprintf(out, "# no cache_transceiver_config: this worker cannot serve disaggregated requests\n")
	}
	if len(c.notApplied) > 0 {
		fmt.Fprintf(out, "# accepted, not applied (%d):\n", len(c.notApplied))
		for _, n := range c.notApplied {
			fmt.Fprintf(out, "#   %s\n", n)
		}
	}
	for _, w := range c.warnings {
		fmt.Fprintf(errw, "warning: %s\n", w)
	}
	printErrors(errw, c.err)
}

// printSecret says where the cluster secret is and how long it is; never
// the secret.
func printSecret(out io.Writer, f *config.File, env config.Env) {
	var sec *config.Security
	if f.Kind == config.KindWorker {
		sec = &f.Worker.Security
	} else {
		sec = &f.Cluster.Security
	}
	switch secret, src, serr := sec.LoadSecret(env); {
	case serr != nil:
		fmt.Fprintf(out, "# security: note: the cluster secret cannot be loaded here: %v\n", serr)
	case secret == nil:
		fmt.Fprintf(out, "# security: no cluster secret (%s is unset): unauthenticated, peers limited to loopback and allowed_peer_hosts (kvxfer up generates one)\n", config.EnvClusterSecret)
	default:
		fmt.Fprintf(out, "# security: cluster secret from %s (%d bytes)\n", src, len(secret))
	}
}

// checkDir checks every *.yaml and *.yml file under dir, printing one line
// per file and a total, and returns the number of invalid files.
func checkDir(out, errw io.Writer, dir string, env config.Env, strict bool) int {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if ext := filepath.Ext(p); !d.IsDir() && (ext == ".yaml" || ext == ".yml") {
			paths = append(paths, p)
		}
		return nil
	})
	if err != nil {
		fmt.Fprintf(errw, "error: %v\n", err)
		return 1
	}
	sort.Strings(paths)
	var valid, warned, invalid int
	for _, p := range paths {
		c := checkFile(p, env)
		fmt.Fprintln(out, c.summary(strict))
		switch {
		case !c.ok(strict):
			invalid++
		case len(c.warnings) > 0:
			warned++
		default:
			valid++
		}
		if c.err != nil {
			printErrors(errw, c.err)
		}
	}
	fmt.Fprintf(out, "# %s: %d files: %d valid, %d valid with warnings, %d invalid\n", dir, len(paths), valid, warned, invalid)
	if len(paths) == 0 {
		fmt.Fprintf(errw, "warning: %s: no *.yaml or *.yml file under it\n", dir)
	}
	return invalid
}

// summary is the one line of a file in a directory check.
func (c *checked) summary(strict bool) string {
	if c.f == nil {
		return fmt.Sprintf("%s: invalid (%s)", c.path, firstLine(c.err))
	}
	if c.err != nil {
		n := 1
		if ps, ok := c.err.(config.Problems); ok {
			n = len(ps)
		}
		return fmt.Sprintf("%s: %s file, invalid (%s)", c.path, c.f.Kind, plural(n, "error"))
	}
	if len(c.warnings) == 0 {
		return fmt.Sprintf("%s: %s file, valid", c.path, c.f.Kind)
	}
	status := "valid"
	if strict {
		status = "invalid (--strict)"
	}
	var parts []string
	for _, k := range []struct{ kind, what string }{
		{config.KindNotApplied, "accepted, not applied"}, {config.KindDeprecated, "older form"},
		{config.KindNotUsed, "not used by kvxfer"}, {"", "other"},
	} {
		if n := c.kinds[k.kind]; n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, k.what))
		}
	}
	return fmt.Sprintf("%s: %s file, %s, %s: %s", c.path, c.f.Kind, status, plural(len(c.warnings), "warning"), strings.Join(parts, ", "))
}

// plural is "1 warning", "2 warnings".
func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func firstLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}

func printErrors(w io.Writer, err error) {
	if err == nil {
		return
	}
	if ps, ok := err.(config.Problems); ok {
		for _, p := range ps {
			fmt.Fprintf(w, "error: %s\n", p)
		}
		return
	}
	fmt.Fprintf(w, "error: %v\n", err)
}
