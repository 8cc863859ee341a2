package transceiver

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
)

// Script tests in the manner of etcd raft's and cockroachdb's datadriven
// tests: a file under testdata/ is a list of cases, each one or more
// commands, a "----" line and the output they must produce, up to a blank
// line; lines starting with # are comments. The output of the core scripts
// is the effects of the events, one a line, "(none)" for none. With -update
// the files are rewritten with the output the code produces, so that a
// change of the protocol is reviewed as a diff of the scripts:
//
//	go test ./transceiver -run Script -update

var update = flag.Bool("update", false, "rewrite the scripts under testdata/ with the output the code produces")

// scriptCmd is one command line: a name, bare words and key=value
// arguments (a value may be "quoted, with spaces").
type scriptCmd struct {
	pos   string // file:line
	name  string
	words []string
	args  map[string]string
	used  map[string]bool
}

func parseCmd(pos, line string) (*scriptCmd, error) {
	c := &scriptCmd{pos: pos, args: map[string]string{}, used: map[string]bool{}}
	rest := strings.TrimSpace(line)
	for rest != "" {
		var tok string
		i := strings.IndexFunc(rest, unicode.IsSpace)
		if eq := strings.Index(rest, "="); eq >= 0 && (i < 0 || eq < i) && len(rest) > eq+1 && rest[eq+1] == '"' {
			end := strings.Index(rest[eq+2:], `"`)
			if end < 0 {
				return nil, fmt.Errorf("%s: unterminated quote", pos)
			}
			tok, rest = rest[:eq+2+end+1], rest[eq+2+end+1:]
		} else if i < 0 {
			tok, rest = rest, ""
		} else {
			tok, rest = rest[:i], rest[i:]
		}
		rest = strings.TrimSpace(rest)
		if c.name == "" {
			c.name = tok
			continue
		}
		if k, v, ok := strings.Cut(tok, "="); ok {
			c.args[k] = strings.Trim(v, `"`)
		} else {
			c.words = append(c.words, tok)
		}
	}
	return c, nil
}

func (c *scriptCmd) has(key string) bool {
	_, ok := c.args[key]
	return ok
}

func (c *scriptCmd) str(key, def string) string {
	c.used[key] = true
	if v, ok := c.args[key]; ok {
		return v
	}
	return def
}

func (c *scriptCmd) int(t *testing.T, key string, def int) int {
	v := c.str(key, "")
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s: %s=%q: %v", c.pos, key, v, err)
	}
	return n
}

func (c *scriptCmd) ints(t *testing.T, key string) []int {
	var out []int
	for _, f := range strings.Split(c.str(key, ""), ",") {
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("%s: %s: %v", c.pos, key, err)
		}
		out = append(out, n)
	}
	return out
}

func (c *scriptCmd) dur(t *testing.T, key string, def time.Duration) time.Duration {
	v := c.str(key, "")
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s: %s: %v", c.pos, key, err)
	}
	return d
}

// flag reports whether the bare word w is present.
func (c *scriptCmd) flag(w string) bool {
	c.used["@"+w] = true
	for _, x := range c.words {
		if x == w {
			return true
		}
	}
	return false
}

// check fails the test on arguments the command did not read: a typo must
// not pass silently.
func (c *scriptCmd) check(t *testing.T) {
	t.Helper()
	for k := range c.args {
		if !c.used[k] {
			t.Fatalf("%s: %s: unknown argument %s", c.pos, c.name, k)
		}
	}
	for _, w := range c.words {
		if !c.used["@"+w] {
			t.Fatalf("%s: %s: unknown word %s", c.pos, c.name, w)
		}
	}
}

// scriptItem is a literal line of a script (comment, blank) or a case.
type scriptItem struct {
	literal string
	isCase  bool
	cmds    []string
	lines   []int // line number of each command
	want    string
}

func parseScript(t *testing.T, path string) []scriptItem {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	var items []scriptItem
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#") {
			items = append(items, scriptItem{literal: l})
			continue
		}
		it := scriptItem{isCase: true}
		for ; i < len(lines) && lines[i] != "----"; i++ {
			if strings.TrimSpace(lines[i]) == "" || strings.HasPrefix(lines[i], "#") {
				t.Fatalf("%s:%d: a command block ends with ----", path, i+1)
			}
			it.cmds, it.lines = append(it.cmds, lines[i]), append(it.lines, i+1)
		}
		if i == len(lines) {
			t.Fatalf("%s:%d: no ---- after the commands", path, it.lines[0])
		}
		var out []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != ""; i++ {
			out = append(out, lines[i])
		}
		it.want = strings.Join(out, "\n")
		items = append(items, it)
		if i < len(lines) {
			items = append(items, scriptItem{literal: ""})
		}
	}
	return items
}

// runScripts runs every script matching glob, each as a subtest with a
// fresh interpreter from newInterp; an interpreter returns the output of one
// command.
func runScripts(t *testing.T, glob string, newInterp func() func(t *testing.T, c *scriptCmd) string) {
	files, err := filepath.Glob(glob)
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts match %s (%v)", glob, err)
	}
	for _, path := range files {
		t.Run(strings.TrimSuffix(filepath.Base(path), ".script"), func(t *testing.T) {
			run := newInterp()
			items := parseScript(t, path)
			var out strings.Builder
			for _, it := range items {
				if !it.isCase {
					out.WriteString(it.literal + "\n")
					continue
				}
				var got []string
				for i, line := range it.cmds {
					c, err := parseCmd(fmt.Sprintf("%s:%d", path, it.lines[i]), line)
					if err != nil {
						t.Fatal(err)
					}
					if o := run(t, c); o != "" {
						got = append(got, o)
					}
					c.check(t)
				}
				g := strings.Join(got, "\n")
				if g == "" {
					g = "(none)"
				}
				if g != it.want && !*update {
					t.Errorf("%s:%d:\n%s\n got:\n%s\n want:\n%s", path, it.lines[0], strings.Join(it.cmds, "\n"), g, it.want)
				}
				out.WriteString(strings.Join(it.cmds, "\n") + "\n----\n" + g + "\n")
			}
			if *update {
				if err := os.WriteFile(path, []byte(out.String()), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
