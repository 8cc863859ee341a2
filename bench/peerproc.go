package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/layout"
)

// peerProc is the context-side child process.
type peerProc struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	stderr *lockedWriter
	done   chan error
	name   string // "" for the context process; "context rank [1]" under --process-per-rank

	stopOnce sync.Once
}

// startPeer starts the context process and sends it setup, completed with
// the state cs (nil for a process that only serves the raw TCP baseline).
func startPeer(ctx context.Context, c Config, setup peerSetup, cs *layout.CacheState) (*peerProc, error) {
	p, err := spawnPeer(ctx, c, setup, cs)
	if err != nil {
		return nil, err
	}
	if err := p.waitReady(); err != nil {
		return nil, err
	}
	return p, nil
}

// waitReady reads the process's "ready" (or its error), stopping it when
// it is not ready.
func (p *peerProc) waitReady() error {
	m, err := p.read()
	if err != nil {
		p.stop()
		return err
	}
	if m.Op != "ready" {
		p.stop()
		return fmt.Errorf("bench: %s process: %s", p.role(), m.Error)
	}
	return nil
}

// role names the process in errors.
func (p *peerProc) role() string {
	if p.name != "" {
		return p.name
	}
	return "context"
}

// spawnPeer starts a peer process and sends it setup, completed with the
// state cs (nil for a process that only serves the raw TCP baseline).
func spawnPeer(_ context.Context, c Config, setup peerSetup, cs *layout.CacheState) (*peerProc, error) {
	argv := c.Peer
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		argv = []string{exe, "bench-peer"}
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), c.PeerEnv...)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	p := &peerProc{cmd: cmd, in: in, out: bufio.NewScanner(out), stderr: &lockedWriter{}, done: make(chan error, 1)}
	p.out.Buffer(make([]byte, 1<<16), 1<<22)
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("bench: start context process %v: %w", argv, err)
	}
	go func() { p.done <- cmd.Wait() }()
	if cs != nil {
		setup.State, _ = cs.MarshalBinary()
	} else {
		setup.BaselineOnly = true
	}
	if setup.Group != nil {
		p.name = fmt.Sprintf("%s rank %v", setup.Role, setup.Ranks)
	}
	line, _ := json.Marshal(setup)
	if _, err := fmt.Fprintf(in, "%s\n", line); err != nil {
		p.stop()
		return nil, p.failed("send setup", err)
	}
	return p, nil
}

// lockedWriter keeps the head of the child's stderr for error messages.
type lockedWriter struct {
	mu sync.Mutex
	w  bytes.Buffer
}

func (l *lockedWriter) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.String()
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w.Len() > 64<<10 {
		return len(b), nil // keep the tail bounded
	}
	return l.w.Write(b)
}

func (p *peerProc) failed(op string, err error) error {
	tail := strings.TrimSpace(p.stderr.String())
	if len(tail) > 2000 {
		tail = tail[len(tail)-2000:]
	}
	return fmt.Errorf("bench: %s process: %s: %v\n%s", p.role(), op, err, tail)
}

func (p *peerProc) read() (peerMsg, error) {
	var m peerMsg
	if !p.out.Scan() {
		err := p.out.Err()
		if err == nil {
			err = io.ErrUnexpectedEOF
		}
		return m, p.failed("read", err)
	}
	if err := json.Unmarshal(p.out.Bytes(), &m); err != nil {
		return m, p.failed("decode", err)
	}
	return m, nil
}

func (p *peerProc) send(m peerMsg) error {
	b, _ := json.Marshal(m)
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		return p.failed("write", err)
	}
	return nil
}

func (p *peerProc) prepare(id uint64, tokens int, seed uint64) ([]byte, error) {
	if err := p.send(peerMsg{Op: "prepare", ID: id, Tokens: tokens, Seed: seed}); err != nil {
		return nil, err
	}
	m, err := p.read()
	if err != nil {
		return nil, err
	}
	if m.Error != "" {
		return nil, errors.New(m.Error)
	}
	return base64.StdEncoding.DecodeString(m.Opaque)
}

func (p *peerProc) quit() (peerMsg, error) {
	if err := p.send(peerMsg{Op: "quit"}); err != nil {
		return peerMsg{}, err
	}
	return p.read()
}

// stop closes the child's stdin (it exits on EOF) and kills it if it has not
// exited within a few seconds. Idempotent.
func (p *peerProc) stop() {
	p.stopOnce.Do(func() {
		p.in.Close()
		if p.cmd == nil { // the context rank of an MPI world: not our child
			return
		}
		waitOrKill(p.cmd.Process, p.done, 5*time.Second)
	})
}

// waitOrKill waits for a child process to exit (done delivers its Wait's
// result) and kills it if it has not within grace.
func waitOrKill(proc *os.Process, done <-chan error, grace time.Duration) {
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		proc.Kill()
		<-done
	}
}

// kill ends the child at once (tests of a context process that dies).
func (p *peerProc) kill() {
	if p.cmd == nil {
		p.in.Close()
		return
	}
	p.cmd.Process.Kill()
}
