package repotest

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// module is this module's path; imports below it are checked against the
// table, as paths relative to it.
const module = "github.com/kvxfer/kvxfer"

// A rule says what the Go files of a package may import: the rows of
// DESIGN.md's package table, plus the internal/ helpers. A path ending in
// "/..." stands for the package and every package below it. A package may
// always import the packages in the directories below its own
// (transceiver/internal/wire, bench/benchtest) and the standard library.
type rule struct {
	pkg   string   // the package (or, with "/...", the tree) the row is about
	may   []string // module packages its files may import; "*" is any but cmd/...
	tests []string // more module packages its _test.go files may import
	ext   []string // packages outside the module and the standard library its files may import
	// testExt: more packages outside the module its _test.go files may
	// import.
	testExt []string
}

// testExt may be imported by every test, beyond a row's ext.
var testExt = []string{"go.uber.org/goleak", "github.com/google/go-cmp/..."}

// boundaries is the table. Every package of the module has one row (the
// most specific that names it); a row that names no package fails too.
var boundaries = []rule{
	// Its chaos-tagged file registers the fault-injecting data plane.
	{pkg: "cmd/kvxfer", may: []string{"internal/cli", "transport/faultinject"}},
	// The C ABI (go build -buildmode=c-shared): thin exports over
	// internal/capi, which holds the logic so that it is tested in Go.
	{pkg: "cmd/libkvxfer", may: []string{"internal/capi", "config", "kvcache", "layout", "internal/buildinfo"}},
	// The C ABI's logic: handles, codes, config loading as config check
	// does, pools over the caller's memory; it registers the tcp and shm
	// data planes the library carries.
	{pkg: "internal/capi", may: []string{"transceiver", "kvcache", "layout", "config", "internal/tlsconf", "transport", "transport/tcp", "transport/shm"},
		tests: []string{"internal/freeport"}},
	{pkg: "internal/cli", may: []string{"*"}, ext: []string{"github.com/spf13/cobra", "github.com/spf13/pflag"}},
	// The launcher behind `kvxfer up`: worker processes and the router.
	// With disagg_cluster it opens the router's membership store
	// (connect for etcd, memstore for the built-in one).
	{pkg: "internal/launch", may: []string{"serve", "config", "metrics", "internal/tlsconf", "internal/freeport", "membership/connect", "membership/memstore"},
		tests: []string{"membership", "membership/membershiptest", "internal/syncbuf"}},
	// serve names prometheus.Registry (Worker.Registry, Router.Registry);
	// the collectors themselves are package metrics'. Its tests register
	// the data planes that their workers use (tcp; ucx with -tags ucx), as
	// kvxfer's main does.
	// With disagg_cluster the router watches the membership (a View on a
	// Store the CLI opens) and serves the built-in store's handler
	// (memstore) on its own listener; a worker builds its Record.
	// It names transport.Transport only to pass a data-plane wrapper
	// (WorkerOptions.WrapDataPlane, fault injection) to the transceiver.
	// It hashes prompts as the KV cache does (kvcache.HashBlocks) for the
	// kv_cache_aware router, which matches them to the workers' events.
	// Its tests of the router's timing run under testing/synctest over
	// internal/memnet.
	{pkg: "serve", may: []string{"engine", "transceiver", "config", "metrics", "internal/netlimit", "internal/tlsconf",
		"membership", "membership/memstore", "layout", "transport", "kvcache"},
		tests: []string{"transport/tcp", "transport/ucx", "internal/syncbuf", "internal/freeport", "internal/memnet"}, ext: []string{"github.com/prometheus/client_golang/prometheus"}},
	// engine's tests wire real transceivers between instances, as serve
	// does: they build the config and register the tcp data plane.
	// Its transfer-failure logs are rate-limited (netlimit.RateLog), which
	// its tests read from a syncbuf.
	{pkg: "engine", may: []string{"transceiver", "kvcache", "layout", "internal/netlimit"}, tests: []string{"config", "transport/tcp", "internal/syncbuf"}},
	// bench builds the CacheTransceiver each side's transceiver.New reads,
	// as serve does (hence config, which DESIGN.md's row omits).
	// The speed targets, read from the bench's JSON reports: on nothing of
	// the module (it decodes the reports' schema itself).
	{pkg: "bench/perfreport"},
	// make bench-report's last step.
	{pkg: "cmd/perfreport", may: []string{"bench/perfreport"}},
	{pkg: "bench", may: []string{"transceiver", "kvcache", "layout", "transport", "config", "internal/buildinfo", "internal/tlsconf", "internal/freeport"},
		tests: []string{"transport/..."}, ext: []string{"gonum.org/v1/plot/..."}},
	// Test helpers of bench reports (the compiled JSON Schema).
	{pkg: "bench/benchtest", may: []string{"bench"}, ext: []string{"github.com/santhosh-tekuri/jsonschema/v6"}},
	// The serving benchmark (kvxfer bench serve): HTTP clients of a router
	// or worker, never the serving code itself; bench's report machinery
	// (machine, progress bar, chart styles); its tests check the report's
	// JSON Schema.
	{pkg: "bench/serving", may: []string{"bench", "internal/buildinfo"}, tests: []string{"bench/benchtest"},
		ext: []string{"gonum.org/v1/plot/...", "github.com/santhosh-tekuri/jsonschema/v6"}},
	{pkg: "transceiver/...", may: []string{"transport", "layout", "kvcache", "config", "internal/netlimit", "internal/accept", "internal/wirefield"},
		tests: []string{"transport/...", "internal/syncbuf", "internal/tlsconf", "internal/memnet"}},
	// The control connections of a rank: frames, the accept loop, the
	// listener's limits; never requests, layouts or transports.
	{pkg: "transceiver/internal/control", may: []string{"transceiver/internal/wire", "internal/netlimit", "internal/accept"},
		tests: []string{"internal/memnet"}},
	// The data mover: one pair's bytes over a data plane, packed and
	// unpacked with a layout plan; never frames, requests or the control
	// connections (the caller announces chunks). Its tests move over tcp.
	{pkg: "transceiver/internal/mover", may: []string{"transport", "layout"}, tests: []string{"kvcache", "transport/tcp"}},
	// The goroutines of a rank's sends and receives: on nothing.
	{pkg: "transceiver/internal/workers"},
	// Reaching a context rank: its control connection and the pair's data
	// plane (chosen from the Hellos, probed for shm); never requests,
	// frames' meaning or layouts.
	{pkg: "transceiver/internal/link", may: []string{"transceiver/internal/control", "transceiver/internal/wire", "transport"},
		tests: []string{"internal/memnet"}},
	// The backends share the receipt table and connection helpers of
	// transport/internal, the accept loop and, for shm, memory files.
	{pkg: "transport/...", may: []string{"transport", "transport/internal/...", "internal/netlimit", "internal/accept", "internal/memfd", "internal/memcopy", "internal/hugepage"},
		tests: []string{"transport/transporttest", "internal/syncbuf", "internal/tlsconf", "internal/procnet"}, ext: []string{"golang.org/x/sys/..."}},
	// As transport/..., and its tests mount a FUSE file system (go-fuse)
	// for a file whose close blocks, which a hostile peer sends.
	{pkg: "transport/shm", may: []string{"transport", "transport/internal/...", "internal/netlimit", "internal/accept", "internal/memfd", "internal/memcopy", "internal/hugepage"},
		tests: []string{"transport/transporttest", "internal/syncbuf", "internal/tlsconf", "internal/procnet"}, ext: []string{"golang.org/x/sys/..."},
		testExt: []string{"github.com/hanwen/go-fuse/v2/..."}},
	// The fault-injecting wrapper of any backend (the chaos suite's): it
	// wraps transports by their interface only; its tests run it over tcp.
	{pkg: "transport/faultinject", may: []string{"transport"}, tests: []string{"transport/tcp", "transport/transporttest"}},
	// The chaos suite: real worker and router processes under faults, and
	// engines over the faulty data plane in process. Test code only.
	{pkg: "tests/chaos", may: []string{"*"}},
	// The conformance suite every backend passes: test code, so goleak.
	{pkg: "transport/transporttest", may: []string{"transport"}, ext: []string{"go.uber.org/goleak"}},
	{pkg: "layout", may: []string{"kvcache", "internal/memcopy"}},
	// Shared-memory arenas are memory files (internal/memfd).
	{pkg: "kvcache", may: []string{"internal/memfd"}},
	// It polls a named pipe given as a config file for a writer
	// (x/sys/unix's poll), so that one with none does not block it.
	{pkg: "config", ext: []string{"go.yaml.in/yaml/v3", "golang.org/x/sys/unix"}},
	{pkg: "metrics", ext: []string{"github.com/prometheus/client_golang/..."}},
	// Dynamic membership (disagg_cluster): the contract, Member and View,
	// on nothing of the module.
	{pkg: "membership"},
	// The built-in store and its HTTP service; its tests run the
	// conformance suite.
	{pkg: "membership/memstore", may: []string{"membership"}, tests: []string{"membership/membershiptest"}},
	// The etcd store, on etcd's client (which brings gRPC and zap).
	{pkg: "membership/etcdstore", may: []string{"membership"}, tests: []string{"membership/membershiptest", "internal/tlsconf"},
		ext: []string{"go.etcd.io/etcd/...", "go.uber.org/zap"}},
	// Where the disagg_cluster block meets the stores: it opens the one
	// the cluster_uri names.
	{pkg: "membership/connect", may: []string{"config", "membership", "membership/memstore", "membership/etcdstore", "internal/tlsconf"},
		tests: []string{"membership/membershiptest"}},
	// The conformance suite every store passes: test code, so goleak.
	{pkg: "membership/membershiptest", may: []string{"membership", "internal/freeport", "internal/tlsconf"}, ext: []string{"go.uber.org/goleak"}},
	// Helpers under internal/: each is below everything that uses it.
	// The bounded fields of the control frames and the group messages.
	{pkg: "internal/wirefield"},
	{pkg: "internal/netlimit", tests: []string{"internal/syncbuf"}},
	// Config.Transport hands the configs to the data planes.
	{pkg: "internal/tlsconf", may: []string{"transport"}},
	{pkg: "internal/buildinfo"},
	// The accept loop with backoff of every listener (transports and the
	// transceiver's control plane).
	{pkg: "internal/accept"},
	// Memory files, seals and peer mappings on x/sys/unix.
	{pkg: "internal/memfd", ext: []string{"golang.org/x/sys/..."}},
	{pkg: "internal/procnet"},
	// Copies with non-temporal stores (layout's packing, the receipts'
	// scatter); x/sys/cpu says whether the processor has AVX.
	{pkg: "internal/memcopy", ext: []string{"golang.org/x/sys/cpu"}},
	// Transparent huge-page advice on the pools a data plane moves
	// (transport/mpi's RegisterMemory).
	{pkg: "internal/hugepage"},
	{pkg: "internal/freeport"},
	{pkg: "internal/syncbuf"},
	// An in-memory network for tests under testing/synctest (test support
	// only).
	{pkg: "internal/memnet"},
	{pkg: "internal/repotest"},
	// Cross-host tests (test code only): the CLI in child processes
	// spread over network namespaces (entered with x/sys/unix's Setns),
	// their listeners read from /proc.
	{pkg: "tests/crosshost", tests: []string{"internal/cli", "internal/procnet", "internal/freeport"}, ext: []string{"golang.org/x/sys/..."}},
}

// matches reports whether path is pattern's package (or, for "x/...", x or
// a package below it).
func matches(pattern, path string) bool {
	if tree, ok := strings.CutSuffix(pattern, "/..."); ok {
		return path == tree || strings.HasPrefix(path, tree+"/")
	}
	return path == pattern
}

// ruleFor returns the most specific row for the package at dir.
func ruleFor(dir string) (rule, bool) {
	var best rule
	found := false
	for _, r := range boundaries {
		if matches(r.pkg, dir) && (!found || len(strings.TrimSuffix(r.pkg, "/...")) > len(strings.TrimSuffix(best.pkg, "/..."))) {
			best, found = r, true
		}
	}
	return best, found
}

// allowed reports whether a file of dir, under rule r, may import the
// module package p.
func (r rule) allowed(dir, p string, test bool) bool {
	if p == dir || strings.HasPrefix(p, dir+"/") {
		return true // its own packages below it
	}
	list := r.may
	if test {
		list = append(slices.Clone(r.may), r.tests...)
	}
	return slices.ContainsFunc(list, func(m string) bool {
		return m == "*" && !matches("cmd/...", p) || matches(m, p)
	})
}

// allowedExt reports whether a file under rule r may import p, a package
// outside the module.
func (r rule) allowedExt(p string, test bool) bool {
	if first, _, _ := strings.Cut(p, "/"); !strings.Contains(first, ".") {
		return true // the standard library (and cgo's "C")
	}
	list := r.ext
	if test {
		list = slices.Concat(r.ext, testExt, r.testExt)
	}
	return slices.ContainsFunc(list, func(m string) bool { return matches(m, p) })
}

// TestBoundaries enforces the package table of DESIGN.md: every import of
// every Go file of the module (tests and files behind build tags
// included), module packages and outside ones alike, is one its package's
// row allows.
func TestBoundaries(t *testing.T) {
	root := filepath.Join("..", "..")
	used := map[string]bool{}
	files := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && path != root || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		rel, _ := filepath.Rel(root, filepath.Dir(path))
		dir := filepath.ToSlash(rel)
		r, ok := ruleFor(dir)
		if !ok {
			t.Errorf("%s: package %s has no row in the boundary table", path, dir)
			return nil
		}
		used[r.pkg] = true
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		files++
		test := strings.HasSuffix(path, "_test.go")
		for _, imp := range f.Imports {
			p, _ := strconv.Unquote(imp.Path.Value)
			if mp, ok := strings.CutPrefix(p, module+"/"); ok {
				if !r.allowed(dir, mp, test) {
					t.Errorf("%s imports %s: package %s may import %s (tests also %s)", path, mp, dir, r.may, r.tests)
				}
			} else if !r.allowedExt(p, test) {
				t.Errorf("%s imports %s: package %s may import outside the module only %s", path, p, dir, r.ext)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 100 {
		t.Fatalf("checked only %d files: did the tree move?", files)
	}
	for _, r := range boundaries {
		if !used[r.pkg] {
			t.Errorf("the row of %s names no package: remove it or fix its path", r.pkg)
		}
	}
}

// TestBoundaryRules: the table's own logic, on imports that must be caught
// and some that must not. Module packages are written relative to the
// module; outside ones in full.
func TestBoundaryRules(t *testing.T) {
	for _, tc := range []struct {
		dir, imp string
		test     bool
		want     bool
	}{
		{"transport/tcp", "config", false, false}, // nothing below transceiver reads the config
		{"transport/tcp", "config", true, false},  // not even in tests
		{"transport/tcp", "kvcache", false, false},
		{"transport/shm", "kvcache", false, false}, // memory files come from internal/memfd
		{"transport/shm", "internal/memfd", false, true},
		{"transport/shm", "github.com/hanwen/go-fuse/v2/fs", true, true},   // its FUSE test
		{"transport/shm", "github.com/hanwen/go-fuse/v2/fs", false, false}, // only there
		{"transport/tcp", "github.com/hanwen/go-fuse/v2/fs", true, false},
		{"transport/tcp", "transport/internal/receipt", false, true},
		{"transceiver", "transport/internal/receipt", false, false},
		{"transceiver", "internal/accept", false, true},
		{"kvcache", "internal/memfd", false, true},
		{"internal/memfd", "kvcache", false, false},
		{"layout", "config", true, false},
		{"kvcache", "layout", false, false},
		{"serve", "transport", false, true}, // WorkerOptions.WrapDataPlane
		{"serve", "transport/tcp", false, false},
		{"serve", "transport/tcp", true, true},
		{"serve", "kvcache", false, true}, // kv_cache_aware hashes prompts as the pool does
		{"engine", "serve", false, false},
		{"engine", "config", false, false},
		{"engine", "config", true, true},
		{"transceiver", "transceiver/internal/wire", false, true},
		{"transceiver/internal/wire", "transceiver", false, false},
		{"transceiver", "transceiver/internal/control", false, true},
		{"transceiver/internal/control", "transceiver/internal/wire", false, true},
		{"transceiver/internal/control", "transceiver", false, false},
		{"transceiver/internal/control", "transport", false, false}, // frames and peers, never data planes
		{"transceiver/internal/control", "layout", false, false},
		{"transceiver/internal/control", "internal/memnet", true, true},
		{"transceiver", "internal/memnet", false, false}, // test support stays in tests
		{"transport/tcp", "transport/shm", false, false},
		{"transport/tcp", "transport/transporttest", true, true},
		{"internal/cli", "cmd/kvxfer", false, false},
		{"internal/cli", "bench", false, true},
		{"bench/serving", "serve", false, false}, // a client over HTTP only
		{"bench/serving", "bench", false, true},
		{"cmd/kvxfer", "serve", false, false},
		{"metrics", "serve", false, false},
		{"config", "go.yaml.in/yaml/v3", false, true},
		{"config", "gopkg.in/yaml.v3", false, false},
		{"kvcache", "golang.org/x/sys/unix", false, false},
		{"transport/shm", "golang.org/x/sys/unix", false, true},
		{"serve", "github.com/prometheus/client_golang/prometheus", false, true},
		{"serve", "github.com/prometheus/client_golang/prometheus/promhttp", false, false},
		{"layout", "go.uber.org/goleak", true, true},
		{"membership", "config", false, false}, // the contract reads no file
		{"membership", "membership/memstore", true, true},
		{"membership/memstore", "membership/etcdstore", false, false},
		{"membership/memstore", "go.etcd.io/etcd/client/v3", false, false},
		{"membership/etcdstore", "go.etcd.io/etcd/client/v3", false, true},
		{"serve", "go.etcd.io/etcd/client/v3", false, false}, // the router reaches etcd through membership
		{"layout", "go.uber.org/goleak", false, false},
	} {
		r, ok := ruleFor(tc.dir)
		if !ok {
			t.Fatalf("no row for %s", tc.dir)
		}
		got := r.allowed(tc.dir, tc.imp, tc.test)
		if first, _, _ := strings.Cut(tc.imp, "/"); strings.Contains(first, ".") {
			got = r.allowedExt(tc.imp, tc.test)
		}
		if got != tc.want {
			t.Errorf("%s (test %v) importing %s: allowed %v, want %v", tc.dir, tc.test, tc.imp, got, tc.want)
		}
	}
}
