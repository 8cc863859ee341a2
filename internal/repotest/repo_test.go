package repotest

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryPackageHasDoc: each directory with Go files has a doc.go whose
// package comment starts "Package <name>" (or "Command <name>" for main).
func TestEveryPackageHasDoc(t *testing.T) {
	root := filepath.Join("..", "..")
	dirs := map[string]bool{}
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && path != root || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			dirs[filepath.Dir(path)] = true
		}
		return nil
	})
	if len(dirs) < 3 {
		t.Fatalf("found only %d package directories", len(dirs))
	}
	for dir := range dirs {
		name := "doc.go"
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			name = "main.go" // a command documents itself in main.go
		}
		f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(dir, name), nil, parser.PackageClauseOnly|parser.ParseComments)
		if err != nil {
			t.Errorf("%s: no doc.go: %v", dir, err)
			continue
		}
		want := "Package " + f.Name.Name + " "
		if f.Name.Name == "main" {
			want = "Command "
		}
		if f.Doc == nil || !strings.HasPrefix(f.Doc.Text(), want) {
			t.Errorf("%s/%s: package comment must start with %q", dir, name, want)
		}
	}
}

// maxTrackedBytes bounds a file the repository tracks: sources, docs,
// charts and golden files are far below it; a build output is far above.
const maxTrackedBytes = 1 << 20

// TestNoBuildOutputTracked: no tracked file is larger than maxTrackedBytes
// or an executable ELF file (a binary built at the top level once slipped
// into a commit). Skipped outside a git checkout.
func TestNoBuildOutputTracked(t *testing.T) {
	root := filepath.Join("..", "..")
	out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output()
	if err != nil {
		t.Skipf("not a git checkout, or no git: %v", err)
	}
	files := strings.Split(strings.TrimRight(string(out), "\x00"), "\x00")
	if len(files) < 10 {
		t.Fatalf("git ls-files listed only %d files", len(files))
	}
	for _, f := range files {
		p := filepath.Join(root, f)
		st, err := os.Lstat(p)
		if err != nil || !st.Mode().IsRegular() {
			continue // deleted in the working tree, or a link
		}
		if st.Size() > maxTrackedBytes {
			t.Errorf("%s is tracked and %d bytes (limit %d): a build output or data file that belongs outside the repository", f, st.Size(), maxTrackedBytes)
			continue
		}
		head := make([]byte, 4)
		if fh, err := os.Open(p); err == nil {
			n, _ := fh.Read(head)
			fh.Close()
			if n == 4 && string(head) == "\x7fELF" {
				t.Errorf("%s is tracked and is an ELF binary", f)
			}
		}
	}
}
