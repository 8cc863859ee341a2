package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/netlimit"
	"github.com/kvxfer/kvxfer/serve"
	"github.com/spf13/cobra"
)

// adminFlag is the address of the admin listener (net/http/pprof). It is
// off unless --admin-addr names one: "unix:PATH", a socket that only this
// process's user (and root) may use, or "HOST:PORT", which any process that
// can reach it may use. pprof hands whoever asks the process's goroutine
// stacks and command line, CPU profiles and execution traces, and lets
// them stop the world (a stack dump) or force a collection (?gc=1) as
// often as they like: on a host whose other processes are not trusted
// (README, Security) that is for the worker's own user only.
type adminFlag struct{ addr string }

func (a *adminFlag) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&a.addr, "admin-addr", "", "admin listener for /debug/pprof/, off by default: unix:PATH (a socket of mode 0600 that only this user and root may use) or HOST:PORT (unauthenticated: any process that can reach it may profile this one)")
}

// start serves /debug/pprof/ on the admin address until ctx ends or the
// returned stop function is called; stop also waits for the goroutine it
// started (a socket file it made goes with the listener).
func (a *adminFlag) start(ctx context.Context, log *slog.Logger) (stop func(), err error) {
	if a.addr == "" {
		return func() {}, nil
	}
	ln, err := a.listen(log)
	if err != nil {
		return nil, fmt.Errorf("--admin-addr %s: %w", a.addr, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	ln = serve.LimitListener(ln, "admin", serve.HTTPLimits{}, log, nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHTTP(ctx, ln, serve.NewHTTPServer(mux, serve.HTTPLimits{}), slog.New(slog.DiscardHandler))
	}()
	return func() { cancel(); <-done }, nil
}

// listen opens the admin listener and logs it.
func (a *adminFlag) listen(log *slog.Logger) (net.Listener, error) {
	path, isUnix := strings.CutPrefix(a.addr, "unix:")
	if !isUnix {
		ln, err := net.Listen("tcp", a.addr)
		if err != nil {
			return nil, err
		}
		log.Warn("listening", "plane", "admin", "addr", ln.Addr().String(), "pprof", "http://"+ln.Addr().String()+"/debug/pprof/",
			"auth", "none: any process that can connect may read this process's stacks, command line and profiles and pause it; use unix:PATH for a socket of this user's only")
		return ln, nil
	}
	if path == "" {
		return nil, errors.New("unix: needs a path")
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, err
	}
	// Another user who connects between the bind and the chmod is
	// refused by ownerListener all the same.
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	ul.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ul.Close()
		return nil, err
	}
	log.Info("listening", "plane", "admin", "addr", "unix:"+path, "auth", "this user's and root's processes only (mode 0600, peer credentials checked)",
		"pprof", "curl --unix-socket "+path+" http://admin/debug/pprof/")
	return &ownerListener{UnixListener: ul, uid: os.Geteuid(), refusals: netlimit.NewRateLog(log, time.Second)}, nil
}

// removeStaleSocket removes a socket file at path that nothing listens on
// (left by a process that died), and refuses a live one or any other file.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("%s: another process listens on it", path)
	}
	return os.Remove(path)
}

// ownerListener accepts only connections whose peer process runs as uid
// or as root (SO_PEERCRED): the socket file's mode keeps others out, and
// this keeps them out should the mode be changed or the socket be reached
// otherwise.
type ownerListener struct {
	*net.UnixListener
	uid      int
	refusals *netlimit.RateLog
}

func (l *ownerListener) Accept() (net.Conn, error) {
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return nil, err
		}
		uid, err := peerUID(c)
		if err == nil && (uid == l.uid || uid == 0) {
			return c, nil
		}
		c.Close()
		if err != nil {
			l.refusals.Warn("admin-peer", "admin connection refused: its peer's credentials cannot be read", "err", err)
		} else {
			l.refusals.Warn("admin-peer", "admin connection refused: its peer runs as another user", "peer_uid", uid, "uid", l.uid)
		}
	}
}

// peerUID returns the user id of the process at the other end of c.
func peerUID(c *net.UnixConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *syscall.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, cerr
	}
	return int(cred.Uid), nil
}
