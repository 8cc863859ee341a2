package chaos

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// usage is what a process holds at one moment: its goroutines, read from
// its goroutine profile over its admin socket (--admin-addr unix:PATH),
// and its open files, read from its /metrics.
//
// The leak checks compare what is not parked in a bounded pool: idle HTTP
// keep-alive connections and the transceiver's idle workers come and go
// with the load and are not leaks. A stalled worker makes the router open
// more connections to the others, which stay idle in its pool (up to
// MaxIdleConnsPerHost) until their idle timeout, and a rank keeps up to
// maxIdleWorkers goroutines for its next transfers; counting them made the
// check fail by one goroutine on a run where the router kept 8 more idle
// connections than after the warm-up. A leaked request, handler, job,
// unclosed response body or file still counts: those goroutines are not
// parked where an idle connection or worker waits.
type usage struct {
	goroutines int            // all of them
	parked     int            // those that idle HTTP connections own, and idle transceiver workers
	conns      int            // HTTP connections, client and server side, idle or busy
	openFDs    int            // process_open_fds
	stacks     map[string]int // the goroutines not parked, by stack
}

// others is the goroutines not parked in a bounded pool.
func (u usage) others() int { return u.goroutines - u.parked }

// otherFDs is the open files that are not HTTP connections.
func (u usage) otherFDs() int { return u.openFDs - u.conns }

// adminPath is the admin socket of p (every incarnation's).
func (p *proc) adminPath() string { return filepath.Join(p.logDir, p.name+".admin") }

// usage reads what p holds.
func (c clients) usage(p *proc) (usage, error) {
	m, err := c.metrics(p)
	if err != nil {
		return usage{}, err
	}
	hc := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", p.adminPath())
		},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://admin/debug/pprof/goroutine?debug=1", nil)
	resp, err := hc.Do(req)
	if err != nil {
		return usage{}, fmt.Errorf("%s goroutine profile: %w", p.name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return usage{}, fmt.Errorf("%s goroutine profile: %s", p.name, resp.Status)
	}
	u, err := parseGoroutines(resp.Body)
	if err != nil {
		return usage{}, fmt.Errorf("%s goroutine profile: %w", p.name, err)
	}
	u.openFDs = m.openFDs
	return u, nil
}

// parseGoroutines reads a goroutine profile in its text form (debug=1):
// groups of goroutines with the same stack, each a line "N @ addresses"
// followed by one "#\taddress\tfunction+offset\tfile:line" line per frame,
// the innermost first.
func parseGoroutines(r io.Reader) (usage, error) {
	u := usage{stacks: map[string]int{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	n, total := 0, -1
	var frames []string
	flush := func() {
		if n > 0 {
			u.goroutines += n
			u.add(n, frames)
		}
		n, frames = 0, frames[:0]
	}
	for sc.Scan() {
		line := sc.Text()
		if t, ok := strings.CutPrefix(line, "goroutine profile: total "); ok {
			v, err := strconv.Atoi(strings.TrimSpace(t))
			if err != nil {
				return u, fmt.Errorf("total %q: %w", t, err)
			}
			total = v
			continue
		}
		if c, _, ok := strings.Cut(line, " @ "); ok && !strings.HasPrefix(line, "#") {
			flush()
			v, err := strconv.Atoi(c)
			if err != nil {
				return u, fmt.Errorf("group %q: %w", line, err)
			}
			n = v
			continue
		}
		if f, ok := strings.CutPrefix(line, "#\t"); ok && n > 0 {
			// address, function+offset, file:line
			parts := strings.Split(f, "\t")
			if len(parts) >= 2 {
				fn, _, _ := strings.Cut(parts[1], "+")
				frames = append(frames, fn)
			}
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return u, err
	}
	if total < 0 {
		return u, fmt.Errorf("no total line")
	}
	if u.goroutines != total {
		return u, fmt.Errorf("groups add up to %d goroutines, total says %d", u.goroutines, total)
	}
	return u, nil
}

// add classifies a group of n goroutines with the given frames (innermost
// first).
//
// A client connection (net/http.persistConn) has a writer, which always
// waits for the next request, and a reader, which waits in a Peek for the
// next response while the connection is idle or awaits a response (the
// request's own goroutine then counts elsewhere); a reader elsewhere is a
// response whose body is being read or was never closed. A server
// connection (net/http.conn) runs its handlers on its own goroutine: it is
// idle while it waits for a request (a Peek between two, or the first's
// read) with no ServeHTTP frame on its stack; one in its TLS handshake or
// writing an answer counts. An idle transceiver
// worker (workers.Pool) waits in its work loop with no job's frame above
// it.
func (u *usage) add(n int, frames []string) {
	has := func(s string) bool {
		return slices.ContainsFunc(frames, func(f string) bool { return strings.Contains(f, s) })
	}
	i := slices.IndexFunc(frames, func(f string) bool { return !strings.HasPrefix(f, "runtime.") })
	switch {
	case i >= 0 && frames[i] == idleWorkerFrame:
		u.parked += n
		return
	case has("net/http.(*persistConn).writeLoop"):
		u.parked += n
		return
	case has("net/http.(*persistConn).readLoop"):
		u.conns += n
		if has("bufio.(*Reader).Peek") {
			u.parked += n
			return
		}
	case has("net/http.(*conn).serve"):
		u.conns += n
		if !has("ServeHTTP") && (has("bufio.(*Reader).Peek") || has("net/http.(*conn).readRequest")) {
			u.parked += n
			return
		}
	}
	u.stacks[stackKey(frames)] += n
}

// stackKey names a stack for the report of what grew: its innermost frame,
// then up to 6 frames from the first outside the standard library, which
// say whose goroutine it is (a goroutine blocked in a read has 8 frames of
// net, internal/poll and bufio before any of kvxfer's), or for a stack of
// the standard library's only its 6 outermost frames.
func stackKey(frames []string) string {
	// A standard package's path starts with an element without a dot
	// (net, net/http, internal/poll); a module's with a host name.
	std := func(f string) bool {
		first, _, slash := strings.Cut(f, "/")
		if !slash {
			first, _, _ = strings.Cut(f, ".")
		}
		return !strings.Contains(first, ".")
	}
	i := slices.IndexFunc(frames, func(f string) bool { return !std(f) })
	switch {
	case len(frames) == 0:
		return "(no frames outside the runtime)"
	case i == 0 || len(frames) <= 7:
		return strings.Join(frames[:min(len(frames), 7)], " < ")
	case i < 0: // the standard library's only: its outermost frames say whose
		return frames[0] + " < … < " + strings.Join(frames[len(frames)-6:], " < ")
	}
	return frames[0] + " < … < " + strings.Join(frames[i:min(len(frames), i+6)], " < ")
}

// idleWorkerFrame is the function in which a transceiver rank's idle
// worker waits for its next job.
const idleWorkerFrame = "github.com/kvxfer/kvxfer/transceiver/internal/workers.(*Pool).work"

// grown lists the stacks with more goroutines now than in base, the most
// grown first (at most k).
func grown(base, now usage, k int) []string {
	type g struct {
		stack string
		by    int
	}
	var gs []g
	for s, n := range now.stacks {
		if d := n - base.stacks[s]; d > 0 {
			gs = append(gs, g{s, d})
		}
	}
	slices.SortFunc(gs, func(a, b g) int { return cmp.Or(b.by-a.by, strings.Compare(a.stack, b.stack)) })
	var out []string
	for _, x := range gs[:min(len(gs), k)] {
		out = append(out, fmt.Sprintf("+%d %s", x.by, x.stack))
	}
	return out
}

// TestUsageCountsIdleConnectionsOnly checks the classification against
// a process's own profile: an idle keep-alive connection adds connections
// and their goroutines but no other goroutine; a response whose body
// nobody reads adds goroutines the check counts (the reader that waits for
// it and the handler that writes it). It runs in a process of its own (the
// test binary again, this test alone): in the package's, the goroutines
// that earlier tests leave winding down (their idle connections, closed
// servers) come and go under the counts.
func TestUsageCountsIdleConnectionsOnly(t *testing.T) {
	if os.Getenv(usageChildEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^"+t.Name()+"$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), usageChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()) {
			t.Fatalf("in a process of its own: %v\n%s", err, out)
		}
		return
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/big" {
			w.Write(make([]byte, 64<<20))
			return
		}
		io.WriteString(w, "ok")
	}))
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	self := func() usage {
		var b strings.Builder
		if err := pprof.Lookup("goroutine").WriteTo(&b, 1); err != nil {
			t.Fatal(err)
		}
		u, err := parseGoroutines(strings.NewReader(b.String()))
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	// settled waits until cond holds for the profile, and returns it.
	settled := func(what string, cond func(usage) bool) usage {
		deadline := time.Now().Add(5 * time.Second)
		for {
			u := self()
			if cond(u) {
				return u
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %+v", what, u)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	before := self()
	for range 3 {
		resp, err := hc.Get(srv.URL + "/small")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	// The server's connection ends its last request's goroutines (its
	// background read) a moment after the answer is out.
	deadline := time.Now().Add(5 * time.Second)
	idle := self()
	for !(idle.conns == before.conns+2 && idle.parked == before.parked+3 && idle.others() == before.others()) {
		if time.Now().After(deadline) {
			t.Fatalf("one idle connection: %d connections, %d parked, %d others; before %d, %d, %d; grown: %v",
				idle.conns, idle.parked, idle.others(), before.conns, before.parked, before.others(), grown(before, idle, 4))
		}
		time.Sleep(10 * time.Millisecond)
		idle = self()
	}
	resp, err := hc.Get(srv.URL + "/big")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	held := settled("a response body nobody reads", func(u usage) bool { return u.others() >= idle.others()+2 })
	if len(grown(idle, held, 4)) == 0 {
		t.Errorf("no stack grew: %+v", held)
	}
}

// usageChildEnv marks the process TestUsageCountsIdleConnectionsOnly
// runs itself in.
const usageChildEnv = "KVXFER_CHAOS_USAGE_CHILD"

// TestParseGoroutines classifies stacks of a hand-written profile: what
// waits in a bounded pool is parked, anything with work on its stack is
// not.
func TestParseGoroutines(t *testing.T) {
	const profile = "goroutine profile: total 12\n" +
		"3 @ 0x1 0x2\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0x2\truntime.selectgo+0x2\tselect.go:1\n" +
		"#\t0x3\t" + idleWorkerFrame + "+0x3\tworkers.go:1\n\n" +
		"1 @ 0x1\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0x4\tgithub.com/kvxfer/kvxfer/transceiver.(*rank).send+0x1\trank.go:1\n" +
		"#\t0x3\t" + idleWorkerFrame + "+0x3\tworkers.go:1\n\n" +
		"2 @ 0x1\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0x5\tbufio.(*Reader).Peek+0x1\tbufio.go:1\n#\t0x6\tnet/http.(*persistConn).readLoop+0x1\ttransport.go:1\n\n" +
		"2 @ 0x1\n#\t0x1\truntime.selectgo+0x1\tselect.go:1\n#\t0x7\tnet/http.(*persistConn).writeLoop+0x1\ttransport.go:1\n\n" +
		"1 @ 0x1\n#\t0x1\truntime.selectgo+0x1\tselect.go:1\n#\t0x6\tnet/http.(*persistConn).readLoop+0x1\ttransport.go:1\n\n" +
		"1 @ 0x1\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0x5\tbufio.(*Reader).Peek+0x1\tbufio.go:1\n#\t0x8\tnet/http.(*conn).serve+0x1\tserver.go:1\n\n" +
		"1 @ 0x1\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0xa\tcrypto/tls.(*Conn).HandshakeContext+0x1\tconn.go:1\n#\t0x8\tnet/http.(*conn).serve+0x1\tserver.go:1\n\n" +
		"1 @ 0x1\n#\t0x1\truntime.gopark+0x1\tproc.go:1\n#\t0x9\tnet/http.serverHandler.ServeHTTP+0x1\tserver.go:1\n#\t0x8\tnet/http.(*conn).serve+0x1\tserver.go:1\n"
	u, err := parseGoroutines(strings.NewReader(profile))
	if err != nil {
		t.Fatal(err)
	}
	// Parked: 3 idle workers, 2 idle readers, 2 writers, 1 idle server
	// connection. Not: the busy worker, the reader of an unread body, the
	// server connection in its TLS handshake, the handler.
	if u.goroutines != 12 || u.parked != 8 || u.others() != 4 || u.conns != 6 {
		t.Errorf("goroutines %d parked %d others %d conns %d; want 12, 8, 4, 6", u.goroutines, u.parked, u.others(), u.conns)
	}
	read := []string{"internal/poll.runtime_pollWait", "internal/poll.(*pollDesc).wait", "internal/poll.(*FD).Read", "net.(*netFD).Read",
		"net.(*conn).Read", "bufio.(*Reader).fill", "bufio.(*Reader).ReadSlice"}
	for _, c := range []struct {
		frames []string
		want   string
	}{
		{append(slices.Clone(read), "github.com/kvxfer/kvxfer/transport/tcp.(*reader).run", "github.com/kvxfer/kvxfer/transport/tcp.dial"),
			"internal/poll.runtime_pollWait < … < github.com/kvxfer/kvxfer/transport/tcp.(*reader).run < github.com/kvxfer/kvxfer/transport/tcp.dial"},
		{append(slices.Clone(read), "net/http.(*conn).readRequest", "net/http.(*conn).serve"),
			"internal/poll.runtime_pollWait < … < net.(*netFD).Read < net.(*conn).Read < bufio.(*Reader).fill < bufio.(*Reader).ReadSlice < net/http.(*conn).readRequest < net/http.(*conn).serve"},
		{read[:3], "internal/poll.runtime_pollWait < internal/poll.(*pollDesc).wait < internal/poll.(*FD).Read"},
		{nil, "(no frames outside the runtime)"},
	} {
		if k := stackKey(c.frames); k != c.want {
			t.Errorf("stackKey(%q)\n= %s\nwant %s", c.frames, k, c.want)
		}
	}
	if _, err := parseGoroutines(strings.NewReader(strings.Replace(profile, "total 12", "total 13", 1))); err == nil {
		t.Error("a total that the groups do not add up to was accepted")
	}
}
