package config

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestBoundary enforces the rule of DESIGN.md: the public config is read by
// the transceiver constructor and by nothing below it. No file of transport,
// layout or kvcache (tests included) imports package config, and the pure
// cores import no package of kvxfer above them.
func TestBoundary(t *testing.T) {
	const module = "github.com/kvxfer/kvxfer/"
	// transport/shm maps its peers' pool memory with kvcache's memory-file
	// helpers; no other transport package imports kvcache.
	rules := map[string][]string{
		"transport": {"config", "transceiver", "layout", "engine", "serve", "bench", "internal/cli", "metrics"},
		"layout":    {"config", "transceiver", "transport", "engine", "serve", "bench", "internal/cli"},
		"kvcache":   {"config", "transceiver", "transport", "layout", "engine", "serve", "bench", "internal/cli"},
	}
	checked := 0
	for dir, forbidden := range rules {
		root := filepath.Join("..", dir)
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if d.IsDir() || !strings.HasSuffix(path, ".go") {
				return nil
			}
			f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
			if err != nil {
				return err
			}
			checked++
			for _, imp := range f.Imports {
				p, _ := strconv.Unquote(imp.Path.Value)
				if dir == "transport" && p == module+"kvcache" && !strings.HasPrefix(path, filepath.Join(root, "shm")+string(filepath.Separator)) {
					t.Errorf("%s imports %s: only transport/shm may use kvcache", path, p)
				}
				for _, bad := range forbidden {
					if p == module+bad || strings.HasPrefix(p, module+bad+"/") {
						t.Errorf("%s imports %s: package %s must not depend on %s", path, p, dir, bad)
					}
				}
			}
			return nil
		})
		if err != nil && !strings.Contains(err.Error(), "no such file") {
			t.Fatal(err)
		}
	}
	if checked == 0 {
		t.Fatal("no files checked: the package directories moved?")
	}
}
