package crosshost

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/cli"
)

// envChild makes the test binary run the kvxfer command line instead of
// the tests: the processes of a cluster are this binary (as internal/cli's
// tests do), so a -tags ucx test run has UCX in its workers.
const envChild = "KVXFER_CROSSHOST_CHILD"

// EnvRequireNetns, when "1", makes the tests fail instead of skipping
// where network namespaces cannot be made.
const EnvRequireNetns = "KVXFER_REQUIRE_NETNS"

// nsPrefix starts the name of every namespace the tests create; the
// creating process's id follows, so a leftover of a killed run is known.
const nsPrefix = "kvxfer-xh-"

func TestMain(m *testing.M) {
	if os.Getenv(envChild) == "1" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	goleak.VerifyTestMain(labCheck{m})
}

// labCheck fails a run that passed but left behind what its cleanups
// must take back: a network namespace or bridge of this process, or a
// child process (a worker, router or etcd, or an `ip netns exec`).
type labCheck struct{ m *testing.M }

func (c labCheck) Run() int {
	code := c.m.Run()
	if left := labLeftovers(); len(left) > 0 && code == 0 {
		fmt.Fprintf(os.Stderr, "left after the tests:\n%s\n", strings.Join(left, "\n"))
		return 1
	}
	return code
}

// labLeftovers lists this process's namespaces, bridges and child
// processes.
func labLeftovers() []string {
	var left []string
	mine := fmt.Sprintf("%s%d-", nsPrefix, os.Getpid())
	if out, err := exec.Command("ip", "netns", "list").Output(); err == nil {
		for l := range strings.SplitSeq(string(out), "\n") {
			if name, _, _ := strings.Cut(strings.TrimSpace(l), " "); strings.HasPrefix(name, mine) {
				left = append(left, "namespace "+name)
			}
		}
	}
	if _, err := net.InterfaceByName("kxb" + strconv.Itoa(os.Getpid())); err == nil {
		left = append(left, "bridge kxb"+strconv.Itoa(os.Getpid()))
	}
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // ended meanwhile
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		if fs := strings.Fields(string(b[i+1:])); len(fs) > 1 && fs[1] == strconv.Itoa(os.Getpid()) {
			left = append(left, "child process "+strings.TrimSpace(string(b[:i+1])))
		}
	}
	return left
}

// skipNoNetns skips t (or fails it, with EnvRequireNetns=1) with the
// reason network namespaces cannot be made here.
func skipNoNetns(t *testing.T) {
	t.Helper()
	reason := ""
	if _, err := exec.LookPath("ip"); err != nil {
		reason = "no ip command (iproute2) on PATH"
	} else if os.Geteuid() != 0 {
		reason = "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
	} else {
		name := fmt.Sprintf("%s%d-probe", nsPrefix, os.Getpid())
		if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
			reason = fmt.Sprintf("ip netns add fails: %v: %s", err, bytes.TrimSpace(out))
		} else {
			exec.Command("ip", "netns", "delete", name).Run()
		}
	}
	if reason == "" {
		return
	}
	if os.Getenv(EnvRequireNetns) == "1" {
		t.Fatalf("cannot create network namespaces (%s) and %s=1", reason, EnvRequireNetns)
	}
	t.Skipf("skipping: %s (set %s=1 to make this a failure)", reason, EnvRequireNetns)
}

func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
}

// sweepStale deletes the namespaces of earlier runs whose process is gone
// (a run killed before its cleanup).
func sweepStale() {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	for l := range strings.SplitSeq(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(l), " ")
		rest, ok := strings.CutPrefix(name, nsPrefix)
		if !ok {
			continue
		}
		pidS, _, _ := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidS)
		if err != nil || pid == os.Getpid() {
			continue
		}
		if syscall.Kill(pid, 0) == syscall.ESRCH {
			exec.Command("ip", "netns", "delete", name).Run()
		}
	}
	// And their bridges (kxb<pid>); their veths went with the namespaces.
	out, err = exec.Command("ip", "-o", "link", "show", "type", "bridge").Output()
	if err != nil {
		return
	}
	for l := range strings.SplitSeq(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[1], ":")
		pidS, ok := strings.CutPrefix(name, "kxb")
		pid, err := strconv.Atoi(pidS)
		if ok && err == nil && pid != os.Getpid() && syscall.Kill(pid, 0) == syscall.ESRCH {
			exec.Command("ip", "link", "delete", name).Run()
		}
	}
}

// lab is a bridge in this (the test's) namespace with a /24 of 10.x.y.0 on
// it, this namespace at .1, and hosts: network namespaces each joined to
// the bridge by a veth pair (eth0 inside), lo up.
type lab struct {
	t      *testing.T
	id     string // short unique id for interface names
	prefix string // "10.x.y."
	alias  string // another free "10.x.y.", for addresses routed by hand
	bridge string
}

type host struct {
	lab  *lab
	name string // the namespace
	addr string // its eth0 address
	num  int
}

func newLab(t *testing.T) *lab {
	t.Helper()
	skipNoNetns(t)
	sweepStale()
	l := &lab{t: t, id: strconv.Itoa(os.Getpid())} // ≤ 7 digits: interface names stay within 15 bytes
	l.bridge = "kxb" + l.id
	// A /24 no route of this namespace covers.
	routes, _ := exec.Command("ip", "-4", "route", "show", "table", "all").Output()
	for i := range 50 {
		x, y := 200+(os.Getpid()+i)%50, (os.Getpid()/50+i)%250
		p := fmt.Sprintf("10.%d.%d.", x, y)
		if bytes.Contains(routes, []byte(p)) {
			continue
		}
		if l.prefix == "" {
			l.prefix = p
		} else {
			l.alias = p
			break
		}
	}
	if l.alias == "" {
		t.Fatal("no free 10.x.y.0/24 for the lab")
	}
	run(t, "ip", "link", "add", l.bridge, "type", "bridge")
	t.Cleanup(func() { exec.Command("ip", "link", "delete", l.bridge).Run() })
	run(t, "ip", "addr", "add", l.prefix+"1/24", "dev", l.bridge)
	run(t, "ip", "link", "set", l.bridge, "up")
	return l
}

// addHost makes namespace name at address prefix+num on the bridge.
func (l *lab) addHost(name string, num int) *host {
	t := l.t
	t.Helper()
	h := &host{lab: l, name: fmt.Sprintf("%s%d-%s", nsPrefix, os.Getpid(), name), addr: l.prefix + strconv.Itoa(num), num: num}
	run(t, "ip", "netns", "add", h.name)
	t.Cleanup(func() { exec.Command("ip", "netns", "delete", h.name).Run() })
	veth := fmt.Sprintf("kx%sh%d", l.id, num)
	run(t, "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
	t.Cleanup(func() { exec.Command("ip", "link", "delete", veth).Run() }) // gone with the namespace already, usually
	run(t, "ip", "link", "set", veth, "master", l.bridge)
	run(t, "ip", "link", "set", veth, "up")
	h.ip("addr", "add", h.addr+"/24", "dev", "eth0")
	h.ip("link", "set", "eth0", "up")
	h.ip("link", "set", "lo", "up")
	return h
}

// ip runs `ip args` in h's namespace.
func (h *host) ip(args ...string) {
	h.lab.t.Helper()
	run(h.lab.t, append([]string{"ip", "-n", h.name}, args...)...)
}

// listen opens a TCP listener inside h's namespace: a thread enters it,
// opens the socket (which stays in that namespace) and goes back. The
// thread must not end while in another namespace, nor end at all: the
// processes started from it get SIGKILL (Pdeathsig) when it does, which
// is what Go does to a thread whose goroutine exits locked to it.
func (h *host) listen(addr string) (net.Listener, error) {
	type res struct {
		ln  net.Listener
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- res{err: err}
			return
		}
		defer orig.Close()
		f, err := os.Open(filepath.Join("/var/run/netns", h.name))
		if err != nil {
			runtime.UnlockOSThread()
			ch <- res{err: err}
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- res{err: fmt.Errorf("setns %s: %w", h.name, err)}
			return
		}
		ln, err := net.Listen("tcp", addr)
		if berr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); berr != nil {
			ch <- res{ln, err}
			select {} // stuck in h's namespace: keep the thread, and this goroutine, for good
		}
		runtime.UnlockOSThread()
		ch <- res{ln, err}
	}()
	r := <-ch
	return r.ln, r.err
}

// proc is a process of the cluster: this test binary running the CLI,
// in a namespace (or this one).
type proc struct {
	name string
	url  string
	cmd  *exec.Cmd
	logs *syncBuf
	done chan struct{}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// procs starts and, at the test's end, kills processes.
type procs struct {
	t   *testing.T
	env []string
	mu  sync.Mutex
	all []*proc
}

func newProcs(t *testing.T, env ...string) *procs {
	ps := &procs{t: t, env: append(os.Environ(), append([]string{envChild + "=1"}, env...)...)}
	t.Cleanup(ps.killAll)
	return ps
}

// start runs bin args in namespace ns ("" for this one); bin "" is this
// test binary (the CLI).
func (ps *procs) start(name, ns, bin string, args ...string) *proc {
	ps.t.Helper()
	if bin == "" {
		bin = os.Args[0]
	}
	argv := append([]string{bin}, args...)
	if ns != "" {
		argv = append([]string{"ip", "netns", "exec", ns}, argv...)
	}
	p := &proc{name: name, logs: &syncBuf{}, done: make(chan struct{})}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Env = ps.env
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		ps.t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	ps.mu.Lock()
	ps.all = append(ps.all, p)
	ps.mu.Unlock()
	return p
}

// stop sends sig and waits up to limit for the exit, then kills.
func (p *proc) stop(sig syscall.Signal, limit time.Duration) (time.Duration, bool) {
	start := time.Now()
	p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
		return time.Since(start), true
	case <-time.After(limit):
		p.cmd.Process.Kill()
		<-p.done
		return time.Since(start), false
	}
}

func (ps *procs) killAll() {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for _, p := range ps.all {
		p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
	}
	if ps.t.Failed() {
		for _, p := range ps.all {
			ps.t.Logf("%s logs (tail):\n%s", p.name, lastLines(p.logs.String(), 30))
		}
	}
}

func lastLines(s string, n int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}
