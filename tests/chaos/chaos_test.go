package chaos

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

var (
	long     = flag.Bool("chaos.long", false, "run the long chaos suite (make chaos) and print the figures table")
	seedFlag = flag.Uint64("chaos.seed", 0, "seed of the faults and the load (0: from the clock, logged)")
	raceBin  = flag.Bool("chaos.race", false, "build the worker and router binaries with -race (the long suite always does)")
	tableOut = flag.String("chaos.table", "", "also write the figures table (Markdown) to this file")
)

// transferTimeoutMs is the workers' kv_transfer_timeout_ms: short, so a
// run waits little past it, and long enough that a fault-free request on
// a loaded machine under -race is pulled within it (1.5 s was not, once,
// at load 14).
const transferTimeoutMs = 3000

// cluster is the processes of one suite run and the proxies in front of
// the cluster's workers.
type cluster struct {
	t       *testing.T
	dir     string
	c       clients
	ctx     *proc
	gens    []*proc
	ref     *proc
	router  *proc
	proxies map[*proc]*proxy
	base    map[*proc]usage // goroutines and open files after the warm-up
	// migration is whether the router has --migration-limit.
	migration bool
	// stall is the shortest and longest SIGSTOP.
	stall [2]time.Duration
}

func (cl *cluster) workers() []*proc { return append([]*proc{cl.ctx}, cl.gens...) }
func (cl *cluster) all() []*proc {
	return append(cl.workers(), cl.ref, cl.router)
}

func (cl *cluster) routerURL() string { return "http://127.0.0.1:" + strconv.Itoa(cl.router.port) }

// startCluster builds kvxfer and starts every process; they stop at the
// end of the test.
func startCluster(t *testing.T, seed uint64, s suite) *cluster {
	race := s.race
	dir := t.TempDir()
	bin := buildKvxfer(t, dir, race)
	// The reference worker is not under test: without -race it is faster.
	refBin := bin
	if race {
		refBin = buildKvxfer(t, dir, false)
	}
	certs := filepath.Join(dir, "certs")
	if out, err := exec.Command(bin, "certs", "--out", certs, "--names", "ctx0,gen0,gen1,router,harness").CombinedOutput(); err != nil {
		t.Fatalf("kvxfer certs: %v\n%s", err, out)
	}
	cl := &cluster{t: t, dir: dir, c: newClients(t, certs), proxies: map[*proc]*proxy{}, base: map[*proc]usage{}, stall: s.stall}
	tlsArgs := func(name string) []string {
		return []string{"--tls-cert", filepath.Join(certs, name+".pem"), "--tls-key", filepath.Join(certs, name+"-key.pem"), "--tls-ca", filepath.Join(certs, "ca.pem")}
	}
	workerFile := func(name string, tp int) string {
		p := filepath.Join(dir, name+".yaml")
		y := fmt.Sprintf("tensor_parallel_size: %d\npipeline_parallel_size: 1\nkv_cache_config: {tokens_per_block: 16, max_tokens: 8192}\n"+
			"cache_transceiver_config: {backend: TCP, kv_transfer_timeout_ms: %d}\n", tp, transferTimeoutMs)
		if err := os.WriteFile(p, []byte(y), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	secret := fmt.Sprintf("%016x%016x%016x%016x", newRng(seed).next(), newRng(seed+1).next(), newRng(seed+2).next(), newRng(seed+3).next())
	worker := func(name, role string, tp int, tlsOn bool) *proc {
		p := &proc{name: name, bin: bin, port: freePort(t), tls: tlsOn, logDir: dir}
		p.args = []string{"serve", "--role", role, "--config", workerFile(name, tp), "--model", "tiny-gqa",
			"--host", "127.0.0.1", "--port", strconv.Itoa(p.port), "--log-level", "warn"}
		p.args = append(p.args, "--admin-addr", "unix:"+p.adminPath())
		if tlsOn {
			// The cluster's workers sign and check opaque states, as
			// kvxfer up's do.
			p.args = append(p.args, tlsArgs(name)...)
			p.env = []string{"KVXFER_CLUSTER_SECRET=" + secret}
		}
		return p
	}
	cl.ctx = worker("ctx0", "context", 2, true)
	cl.gens = []*proc{worker("gen0", "generation", 1, true), worker("gen1", "generation", 1, true)}
	cl.ref = worker("ref", "both", 1, false)
	cl.ref.bin = refBin
	t.Cleanup(func() {
		for _, p := range cl.all() {
			if p != nil {
				p.stop()
			}
		}
		for _, px := range cl.proxies {
			px.close()
		}
	})
	for _, p := range append(cl.workers(), cl.ref) {
		if err := p.start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, p := range cl.workers() {
		cl.proxies[p] = newProxy(t, "127.0.0.1:"+strconv.Itoa(p.port), seed+uint64(i)+1)
	}
	help, _ := exec.Command(bin, "router", "--help").CombinedOutput()
	cl.migration = strings.Contains(string(help), "--migration-limit")
	cluster := filepath.Join(dir, "cluster.yaml")
	y := fmt.Sprintf("hostname: 127.0.0.1\nport: 8000\ncontext_servers:\n  num_instances: 1\n  urls: [%q]\n"+
		"generation_servers:\n  num_instances: 2\n  urls: [%q, %q]\n  router: {type: round_robin}\n",
		cl.proxies[cl.ctx].addr, cl.proxies[cl.gens[0]].addr, cl.proxies[cl.gens[1]].addr)
	if err := os.WriteFile(cluster, []byte(y), 0o600); err != nil {
		t.Fatal(err)
	}
	cl.router = &proc{name: "router", bin: bin, port: freePort(t), logDir: dir}
	cl.router.args = append([]string{"router", "--config", cluster, "--host", "127.0.0.1", "--port", strconv.Itoa(cl.router.port),
		"--header-timeout", s.headerTimeout.String(), "--chunk-timeout", s.chunkTimeout.String(), "--probe-interval", "200ms", "--health-timeout", "1s",
		"--log-level", "warn", "--admin-addr", "unix:" + cl.router.adminPath()}, tlsArgs("router")...)
	if cl.migration {
		cl.router.args = append(cl.router.args, "--migration-limit", "1")
	}
	for _, p := range append(cl.workers(), cl.ref) {
		if err := cl.c.waitHealthy(p, 60*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if err := cl.router.start(); err != nil {
		t.Fatal(err)
	}
	if err := cl.c.waitHealthy(cl.router, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	return cl
}

// warmUp runs specs through the router without faults (every one must be
// bit-exact), then records each process's goroutines and open files.
func (cl *cluster) warmUp(specs []reqSpec, refs map[string][]int32, c int) {
	t := cl.t
	for _, o := range drive(cl.c.plain, cl.routerURL(), specs, refs, c, 30*time.Second) {
		if o.class != classOK {
			t.Fatalf("warm-up request %d (stream %v) without faults: %s", o.spec.id, o.spec.stream, o.msg)
		}
	}
	time.Sleep(300 * time.Millisecond)
	for _, p := range append(cl.workers(), cl.router) {
		u, err := cl.c.usage(p)
		if err != nil {
			t.Fatal(err)
		}
		cl.base[p] = u
	}
}

// faultKind is one row of the figures.
type faultKind string

const (
	faultNone    faultKind = "none"
	faultKill    faultKind = "kill a busy generation worker (SIGKILL, restart)"
	faultStall   faultKind = "stall a worker (SIGSTOP, SIGCONT)"
	faultDrop    faultKind = "drop router-worker connections"
	faultCorrupt faultKind = "corrupt a byte router<-worker (TLS)"
)

// row is the figures of one fault kind.
type row struct {
	kind                       faultKind
	faults                     int
	requests, ok, failed       int
	wrong                      int
	stranded                   int
	detect                     time.Duration // worst time to detect; -1: no request failed
	leaks                      []string      // goroutines/files not back
	wrongMsgs, failedMsgs      []string
	faultsWithoutDetectionSeen int
}

// event is one injected fault.
type event struct {
	at     time.Time
	target string
}

// inject injects one fault of kind k (on a target chosen with r), waits
// until the cluster has recovered, and returns the event.
func (cl *cluster) inject(k faultKind, r *rng) (event, error) {
	switch k {
	case faultKill:
		g := cl.busyGen(r)
		px := cl.proxies[g]
		ev := event{at: time.Now(), target: g.name}
		g.kill()
		px.pause() // the port is closed while the worker is dead
		time.Sleep(r.duration(200*time.Millisecond, 600*time.Millisecond))
		if err := g.start(); err != nil {
			return ev, err
		}
		if err := cl.c.waitHealthy(g, 30*time.Second); err != nil {
			return ev, err
		}
		return ev, px.resume()
	case faultStall:
		w := cl.workers()[r.intn(len(cl.workers()))]
		ev := event{at: time.Now(), target: w.name}
		w.signal(syscall.SIGSTOP)
		time.Sleep(r.duration(cl.stall[0], cl.stall[1]))
		w.signal(syscall.SIGCONT)
		return ev, nil
	case faultDrop:
		w := cl.workers()[r.intn(len(cl.workers()))]
		ev := event{at: time.Now(), target: w.name}
		n := cl.proxies[w].cut()
		ev.target += fmt.Sprintf(" (%d connections)", n)
		return ev, nil
	case faultCorrupt:
		w := cl.workers()[r.intn(len(cl.workers()))]
		px := cl.proxies[w]
		for len(px.flipped) > 0 {
			<-px.flipped
		}
		px.flip(1)
		select {
		case <-px.flipped:
			return event{at: time.Now(), target: w.name}, nil
		case <-time.After(3 * time.Second):
			px.flip(-1) // nothing passed: withdraw it
			return event{}, nil
		}
	}
	return event{}, fmt.Errorf("unknown fault %q", k)
}

// busyGen returns a generation worker that holds blocks (a request
// transferring or decoding), waiting for one up to 1.5 s; else one at
// random. Killing an idle worker tests less.
func (cl *cluster) busyGen(r *rng) *proc {
	first := r.intn(len(cl.gens))
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		for i := range cl.gens {
			g := cl.gens[(first+i)%len(cl.gens)]
			if m, err := cl.c.metrics(g); err == nil && m.pinned > 0 {
				return g
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cl.gens[first]
}

// waitRecovered waits until every worker and the router answer /health.
func (cl *cluster) waitRecovered(within time.Duration) error {
	deadline := time.Now().Add(within)
	for _, p := range append(cl.workers(), cl.router) {
		if err := cl.c.waitHealthy(p, time.Until(deadline)); err != nil {
			return err
		}
	}
	return nil
}

// runKind drives n requests at concurrency c through the router while it
// injects up to faults faults of kind k, then checks the aftermath.
func (cl *cluster) runKind(k faultKind, specs []reqSpec, refs map[string][]int32, c, faults int, r *rng) row {
	t := cl.t
	done := make(chan []outcome, 1)
	// The requests go on until the last fault is in (and the cluster has
	// recovered from it): a run of a few short requests used to end
	// before the first fault, which then never came.
	faultsIn := make(chan struct{})
	if k == faultNone {
		close(faultsIn)
	}
	go func() { done <- driveUntil(cl.c.plain, cl.routerURL(), specs, refs, c, 60*time.Second, faultsIn) }()
	var events []event
	var outs []outcome
	if k != faultNone {
	loop:
		for range faults {
			select {
			case outs = <-done:
				break loop
			case <-time.After(r.duration(200*time.Millisecond, 700*time.Millisecond)):
			}
			ev, err := cl.inject(k, r)
			if err != nil {
				t.Fatalf("%s: %v", k, err)
			}
			if !ev.at.IsZero() {
				events = append(events, ev)
				t.Logf("%s: %s at %s", k, ev.target, ev.at.Format("15:04:05.000"))
			}
			if err := cl.waitRecovered(30 * time.Second); err != nil {
				t.Fatalf("after %s: %v", k, err)
			}
		}
		close(faultsIn)
	}
	if outs == nil {
		outs = <-done
	}
	rw := row{kind: k, faults: len(events), requests: len(outs), detect: -1}
	for _, o := range outs {
		switch o.class {
		case classOK:
			rw.ok++
		case classFailed:
			rw.failed++
			if len(rw.failedMsgs) < 3 {
				rw.failedMsgs = append(rw.failedMsgs, o.msg)
			}
		case classWrong:
			rw.wrong++
			rw.wrongMsgs = append(rw.wrongMsgs, fmt.Sprintf("request %d (stream %v): %s", o.spec.id, o.spec.stream, o.msg))
		}
	}
	// Time to detect: from each fault to the first request that failed
	// after it (before the next fault).
	for i, ev := range events {
		until := time.Now()
		if i+1 < len(events) {
			until = events[i+1].at
		}
		first := time.Duration(-1)
		for _, o := range outs {
			if o.class == classFailed && !o.end.Before(ev.at) && o.end.Before(until) {
				if d := o.end.Sub(ev.at); first < 0 || d < first {
					first = d
				}
			}
		}
		if first < 0 {
			rw.faultsWithoutDetectionSeen++
		} else if first > rw.detect {
			rw.detect = first
		}
	}
	rw.stranded = cl.stranded()
	rw.leaks = cl.leaks(c)
	return rw
}

// stranded waits past the transfer deadline and returns the blocks still
// pinned on the cluster's workers.
func (cl *cluster) stranded() int {
	time.Sleep(transferTimeoutMs*time.Millisecond + 500*time.Millisecond)
	n := 0
	deadline := time.Now().Add(2 * time.Second)
	for {
		n = 0
		for _, p := range cl.workers() {
			m, err := cl.c.metrics(p)
			if err != nil {
				cl.t.Errorf("metrics of %s: %v", p.name, err)
				continue
			}
			n += m.pinned
		}
		if n == 0 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Slack of the goroutine and open-file checks over the warm-up's level,
// for what is in flight at the moment of a reading or was not used yet at
// the warm-up's: the router's health probes, a request's last goroutines
// on their way out, a connection being dialled or closed, the data-plane
// connections a transceiver dials as its frames need them (a restarted
// worker's are dialled again). Idle HTTP connections and idle transceiver
// workers are not counted (usage); a leak of one goroutine or file per
// request still goes past it within one fault kind's requests.
func slack(c int) (goroutines, files int) { return 2*c + 8, 2*c + 8 }

// connSlack bounds the HTTP connections a process may hold above the
// warm-up's: its idle keep-alive connections are not counted as leaks,
// but each of its HTTP peers (the router and the harness for a worker,
// every worker and the harness for the router) keeps at most the load's
// concurrency in flight, plus a health probe and a migration.
func connSlack(c, peers int) int { return peers * (c + 2) }

// leaks waits up to 5 s for every process's goroutines and open files
// other than idle HTTP connections and workers to be back within the
// slack of the warm-up's, and its HTTP connections within connSlack, and
// returns those that are not, with the stacks that grew.
func (cl *cluster) leaks(c int) []string {
	sg, sf := slack(c)
	deadline := time.Now().Add(5 * time.Second)
	for {
		var bad []string
		for _, p := range append(cl.workers(), cl.router) {
			u, err := cl.c.usage(p)
			b := cl.base[p]
			sc := connSlack(c, 2)
			if p == cl.router {
				sc = connSlack(c, len(cl.workers())+1)
			}
			switch {
			case err != nil:
				bad = append(bad, fmt.Sprintf("%s: %v", p.name, err))
			case u.others() > b.others()+sg || u.otherFDs() > b.otherFDs()+sf || u.conns > b.conns+sc:
				bad = append(bad, fmt.Sprintf("%s: %d goroutines besides idle connections and workers (warm-up %d, slack %d; %d in all), "+
					"%d open files besides HTTP connections (warm-up %d, slack %d), %d HTTP connections (warm-up %d, slack %d); grown: %s",
					p.name, u.others(), b.others(), sg, u.goroutines, u.otherFDs(), b.otherFDs(), sf, u.conns, b.conns, sc, strings.Join(grown(b, u, 4), "; ")))
			}
		}
		if len(bad) == 0 || time.Now().After(deadline) {
			return bad
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// migrationRun kills the generation worker that serves k streams in the
// middle of them, while the other one is up, and returns how many streams
// were cut mid-stream and how many of those still completed bit-exact.
//
// gap is the longest wait of a completed stream from the kill to its next
// tokens.
func (cl *cluster) migrationRun(specs []reqSpec, refs map[string][]int32) (midStream, completed int, gap time.Duration, msgs []string) {
	t := cl.t
	victim, other := cl.gens[0], cl.gens[1]
	// Every stream goes to the victim: the other's port is closed until
	// they have all started.
	cl.proxies[other].pause()
	cl.proxies[other].cut()
	started := make(chan struct{}, len(specs))
	type migrated struct {
		o       outcome
		resumed time.Time // the first tokens after the kill
	}
	outs := make(chan migrated, len(specs))
	var killed atomic.Int64 // UnixNano of the kill
	for _, s := range specs {
		go func() {
			start := time.Now()
			ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
			defer cancel()
			var resumed time.Time
			r := complete(ctx, cl.c.plain, cl.routerURL(), s, func(first bool) {
				if first {
					started <- struct{}{}
				}
				if k := killed.Load(); k != 0 && resumed.IsZero() {
					resumed = time.Now()
				}
			})
			cls, msg := classify(r, refs[s.key()])
			outs <- migrated{outcome{spec: s, class: cls, start: start, end: time.Now(), msg: msg, firstChunk: r.firstChunk}, resumed}
		}()
	}
	// Kill when every stream has started, or 2 s after the first did.
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("migration: no stream started within 30s")
	}
	grace := time.After(2 * time.Second)
wait:
	for range len(specs) - 1 {
		select {
		case <-started:
		case <-grace:
			break wait
		}
	}
	if err := cl.proxies[other].resume(); err != nil {
		t.Fatal(err)
	}
	killedAt := time.Now()
	killed.Store(killedAt.UnixNano())
	victim.kill()
	cl.proxies[victim].pause()
	var all []migrated
	for range specs {
		all = append(all, <-outs)
	}
	if err := victim.start(); err != nil {
		t.Fatal(err)
	}
	if err := cl.c.waitHealthy(victim, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := cl.proxies[victim].resume(); err != nil {
		t.Fatal(err)
	}
	if err := cl.waitRecovered(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	for _, m := range all {
		o := m.o
		if o.end.Before(killedAt) || o.firstChunk.IsZero() || o.firstChunk.After(killedAt) {
			continue // finished before the kill, or not streaming yet: not mid-stream
		}
		midStream++
		switch o.class {
		case classOK:
			completed++
			if !m.resumed.IsZero() {
				gap = max(gap, m.resumed.Sub(killedAt))
			}
		case classWrong:
			t.Errorf("migration: request %d: wrong output: %s", o.spec.id, o.msg)
		default:
			if len(msgs) < 2 {
				msgs = append(msgs, o.msg)
			}
		}
	}
	return midStream, completed, gap, msgs
}

// abandonRun makes the generation phase fail (no generation worker can be
// reached) n times and returns the worst time from the router's answer to
// the context worker's blocks being free again.
func (cl *cluster) abandonRun(specs []reqSpec) (worst time.Duration, n int) {
	t := cl.t
	for _, g := range cl.gens {
		cl.proxies[g].pause()
		cl.proxies[g].cut()
	}
	defer func() {
		for _, g := range cl.gens {
			if err := cl.proxies[g].resume(); err != nil {
				t.Fatal(err)
			}
		}
		if err := cl.waitRecovered(30 * time.Second); err != nil {
			t.Fatal(err)
		}
	}()
	for _, s := range specs {
		s.stream = false
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		r := complete(ctx, cl.c.plain, cl.routerURL(), s, nil)
		cancel()
		answered := time.Now()
		if r.err == nil || !r.clear {
			t.Errorf("abandon: request %d with no generation worker: %v (clear %v), want a clear error", s.id, r.err, r.clear)
			continue
		}
		for {
			m, err := cl.c.metrics(cl.ctx)
			if err != nil {
				t.Fatal(err)
			}
			if m.pinned == 0 {
				break
			}
			if time.Since(answered) > 2*transferTimeoutMs*time.Millisecond {
				t.Errorf("abandon: %d blocks still pinned %v after the router's answer", m.pinned, time.Since(answered))
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		worst = max(worst, time.Since(answered))
		n++
	}
	return worst, n
}

// finalChecks fails the test for processes that exited by themselves and
// for panics and data races in any process's output.
func (cl *cluster) finalChecks() []string {
	var bad []string
	bad2 := regexp.MustCompile(`(?m)^(panic: |fatal error: |WARNING: DATA RACE)`)
	for _, p := range cl.all() {
		p.mu.Lock()
		bad = append(bad, p.crashes...)
		p.mu.Unlock()
		if loc := bad2.FindStringIndex(p.logs()); loc != nil {
			logs := p.logs()
			bad = append(bad, fmt.Sprintf("%s: %s", p.name, logs[loc[0]:min(len(logs), loc[0]+2000)]))
		}
	}
	return bad
}

// suite is one configuration of the chaos suite.
type suite struct {
	requests, concurrency, faults, maxTokens int
	kinds                                    []faultKind
	migrationStreams, migrationTokens        int
	abandon                                  int
	race                                     bool
	// The router's deadlines (long enough for the load's queueing, so
	// that they fire only for faults) and the stalls, which outlast the
	// chunk deadline or not.
	headerTimeout, chunkTimeout time.Duration
	stall                       [2]time.Duration
}

var kinds = []faultKind{faultNone, faultKill, faultStall, faultDrop, faultCorrupt}

func runSuite(t *testing.T, s suite) {
	seed := *seedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("chaos seed %d (rerun with -chaos.seed=%d)", seed, seed)
	began := time.Now()
	cl := startCluster(t, seed, s)
	t.Logf("cluster up in %v (router migration flag: %v)", time.Since(began).Round(time.Millisecond), cl.migration)
	r := newRng(seed)
	pool := makeSpecs(r, 2*s.concurrency+4, s.maxTokens)
	migSpecs := makeSpecs(r, s.migrationStreams, s.migrationTokens)
	for i := range migSpecs {
		migSpecs[i].stream, migSpecs[i].id = true, 1000+i
	}
	refs, err := references(cl.c.plain, "http://127.0.0.1:"+strconv.Itoa(cl.ref.port), append(slices.Clone(pool), migSpecs...))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d references at %v", len(refs), time.Since(began).Round(time.Millisecond))
	cl.warmUp(pool[:2*s.concurrency], refs, s.concurrency)
	t.Logf("references and warm-up done at %v", time.Since(began).Round(time.Millisecond))
	var rows []row
	for _, k := range s.kinds {
		specs := make([]reqSpec, s.requests)
		for i := range specs {
			specs[i] = pool[r.intn(len(pool))]
		}
		kb := time.Now()
		rw := cl.runKind(k, specs, refs, s.concurrency, s.faults, r)
		rows = append(rows, rw)
		t.Logf("%s: %d faults, %d requests: %d bit-exact, %d failed clearly, %d wrong, %d stranded, detect %v (%v)",
			k, rw.faults, rw.requests, rw.ok, rw.failed, rw.wrong, rw.stranded, rw.detect, time.Since(kb).Round(time.Millisecond))
		for _, m := range rw.failedMsgs {
			t.Logf("  e.g. %s", m)
		}
		for _, m := range rw.wrongMsgs {
			t.Errorf("%s: WRONG: %s", k, m)
		}
		if rw.stranded != 0 {
			t.Errorf("%s: %d blocks pinned %v after the run (past the transfer deadline)", k, rw.stranded, transferTimeoutMs*time.Millisecond)
		}
		for _, l := range rw.leaks {
			t.Errorf("%s: not back to the warm-up level: %s", k, l)
		}
		if k == faultNone && rw.ok != rw.requests {
			t.Errorf("no faults, yet %d of %d requests failed", rw.requests-rw.ok, rw.requests)
		}
		if k != faultNone && rw.faults == 0 {
			// (A corruption that finds no byte passing within 3 s is
			// withdrawn and not counted; every other fault counts.)
			t.Errorf("%s: none of %d faults injected while the requests ran", k, s.faults)
		}
	}
	var mid, migrated int
	var migGap time.Duration
	var migMsgs []string
	if s.migrationStreams > 0 {
		mid, migrated, migGap, migMsgs = cl.migrationRun(migSpecs, refs)
		t.Logf("migration: %d streams cut mid-stream, %d completed bit-exact on the other worker (longest gap %v); e.g. %q", mid, migrated, migGap, migMsgs)
	}
	var abandonWorst time.Duration
	var abandonN int
	if s.abandon > 0 {
		abandonWorst, abandonN = cl.abandonRun(pool[:s.abandon])
		t.Logf("abandoned contexts: %d, blocks back within %v of the router's answer", abandonN, abandonWorst)
		if abandonWorst > time.Second {
			t.Errorf("abandoned context blocks took %v to come back (> 1 s)", abandonWorst)
		}
	}
	if st := cl.stranded(); st != 0 {
		t.Errorf("%d blocks pinned at the end", st)
	}
	for _, l := range cl.leaks(s.concurrency) {
		t.Errorf("at the end: %s", l)
	}
	for _, b := range cl.finalChecks() {
		t.Errorf("crash: %s", b)
	}
	table := figures(rows, s, mid, migrated, migGap, cl.migration, abandonWorst, abandonN, seed, time.Since(began))
	t.Logf("figures:\n%s", table)
	appendTable(t, table)
}

// appendTable appends table to the -chaos.table file, when set.
func appendTable(t *testing.T, table string) {
	if *tableOut == "" {
		return
	}
	f, err := os.OpenFile(*tableOut, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err == nil {
		_, err = f.WriteString(table + "\n")
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		t.Error(err)
	}
}

// figures is the Markdown table of the README's Reliability section.
func figures(rows []row, s suite, mid, migrated int, migGap time.Duration, hasMigration bool, abandonWorst time.Duration, abandonN int, seed uint64, took time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| fault | faults | requests | completed bit-exact | failed with a clear error | wrong output | stranded blocks after the deadline | worst time to detect |\n")
	fmt.Fprintf(&b, "|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		det := "–"
		if r.detect >= 0 {
			det = r.detect.Round(time.Millisecond).String()
		}
		if r.faultsWithoutDetectionSeen > 0 && r.kind != faultNone {
			det += fmt.Sprintf(" (%d of %d faults failed no request)", r.faultsWithoutDetectionSeen, r.faults)
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %d | %d | %s |\n", r.kind, r.faults, r.requests, r.ok, r.failed, r.wrong, r.stranded, det)
	}
	b.WriteString("\n")
	if abandonN > 0 {
		fmt.Fprintf(&b, "- Context blocks pinned by abandoned requests (generation phase refused, %d requests): back within %v of the router's answer (worst; goal ≤ 1 s).\n",
			abandonN, abandonWorst.Round(time.Millisecond))
	}
	if mid > 0 {
		flag := "router with --migration-limit 1"
		if !hasMigration {
			flag = "this router has no --migration-limit: no migration"
		}
		fmt.Fprintf(&b, "- Migration when a generation worker is killed mid-stream, a second one up (%s): %d of %d streams completed bit-exact (%.0f%%; goal 100%%).\n",
			flag, migrated, mid, 100*float64(migrated)/float64(mid))
		if migrated > 0 {
			fmt.Fprintf(&b, "  The longest a migrated stream waited from the kill to its next tokens: %v.\n", migGap.Round(time.Millisecond))
		}
	}
	fmt.Fprintf(&b, "- %d requests per fault kind at concurrency %d, max_tokens %d, up to %d faults per kind; SIGSTOP %v-%v; router --header-timeout %v --chunk-timeout %v; kv_transfer_timeout_ms %d; binaries with -race: %v; seed %d; %v in all.\n",
		s.requests, s.concurrency, s.maxTokens, s.faults, s.stall[0], s.stall[1], s.headerTimeout, s.chunkTimeout, transferTimeoutMs, s.race, seed, took.Round(time.Second))
	return b.String()
}

// TestChaosShort is the short chaos suite that go test runs by default.
func TestChaosShort(t *testing.T) {
	if *long {
		t.Skip("-chaos.long: TestChaosLong runs instead")
	}
	if testing.Short() {
		t.Skip("-short")
	}
	runSuite(t, suite{requests: 16, concurrency: 4, faults: 2, maxTokens: 6, kinds: kinds,
		migrationStreams: 3, migrationTokens: 768, abandon: 3, race: *raceBin,
		headerTimeout: 10 * time.Second, chunkTimeout: 3 * time.Second, stall: [2]time.Duration{2 * time.Second, 4 * time.Second}})
}

// TestChaosLong is make chaos: more requests and faults, binaries built
// with -race, and the figures table printed.
func TestChaosLong(t *testing.T) {
	if !*long {
		t.Skip("the long chaos suite runs with -chaos.long (make chaos)")
	}
	runSuite(t, suite{requests: 160, concurrency: 6, faults: 8, maxTokens: 16, kinds: kinds,
		migrationStreams: 6, migrationTokens: 256, abandon: 10, race: true,
		// Workers built with -race on a shared 2-core machine queue
		// prefills for seconds.
		headerTimeout: 20 * time.Second, chunkTimeout: 5 * time.Second, stall: [2]time.Duration{3 * time.Second, 7 * time.Second}})
}
