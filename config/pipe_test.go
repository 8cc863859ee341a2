//go:build unix

package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Named pipes as config files: `kvxfer config check <(render-config)`.
// The bound on the wait for a writer is shortened to pipeTestWait; each
// call runs in a goroutine so that a LoadFile that blocks fails the test
// instead of hanging it, and is released by a writer that opens the pipe
// and closes it at once.

const pipeTestWait = time.Second

// pipeTestSlack is how much longer than the bound a call may take on a
// busy machine.
const pipeTestSlack = 5 * time.Second

const pipeTestConfig = "cache_transceiver_config:\n  backend: TCP\n"

func mkfifo(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	return p
}

// loadPipe runs loadFileWithin on the pipe at p (see readPipeBounded).
func loadPipe(t *testing.T, p string, release func()) (*File, time.Duration, error) {
	t.Helper()
	var f *File
	took, err := readPipeBounded(t, p, release, func() error {
		var err error
		f, err = loadFileWithin(p, Env{}, pipeTestWait)
		return err
	})
	return f, took, err
}

// readPipeBounded runs read, which reads the pipe at p, in a goroutine and
// returns its error and how long it took; when it is still blocked after
// the bound and the slack, the test fails and the read is released: by
// release when not nil, else by a writer that comes and goes.
func readPipeBounded(t *testing.T, p string, release func(), read func() error) (time.Duration, error) {
	t.Helper()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- read() }()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(pipeTestWait + pipeTestSlack):
	}
	t.Errorf("a read of a named pipe still blocked after %v", time.Since(start))
	if release != nil {
		release()
	} else if w, err := os.OpenFile(p, os.O_WRONLY, 0); err == nil {
		w.Close()
	}
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(pipeTestSlack):
		t.Fatalf("a read of a named pipe still blocked after its writer closed")
	}
	return 0, nil
}

// writePipe opens the pipe at p for writing after delay, writes data and
// closes it; the returned channel gives the write's error.
func writePipe(p string, delay time.Duration, data string) <-chan error {
	errc := make(chan error, 1)
	go func() {
		time.Sleep(delay)
		w, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			errc <- err
			return
		}
		_, err = w.WriteString(data)
		w.Close()
		errc <- err
	}()
	return errc
}

// TestHostilePipeNoWriter: a named pipe that nobody opens for writing
// fails within the bound, with an error that names it.
func TestHostilePipeNoWriter(t *testing.T) {
	p := mkfifo(t)
	_, took, err := loadPipe(t, p, nil)
	t.Logf("no writer: %v after %v", err, took)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "named pipe") {
		t.Errorf("got %v, want an error naming %s as a named pipe with no writer", err, p)
	}
	if took < pipeTestWait {
		t.Errorf("gave up after %v, before the bound %v", took, pipeTestWait)
	}
}

// TestHostilePipeStalledWriter: a writer that sends part of a file and
// then nothing fails within the bound too.
func TestHostilePipeStalledWriter(t *testing.T) {
	p := mkfifo(t)
	release := make(chan struct{})
	go func() {
		w, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			return
		}
		w.WriteString("cache_transceiver_config:\n")
		<-release
		w.Close()
	}()
	var once sync.Once
	stop := func() { once.Do(func() { close(release) }) }
	_, took, err := loadPipe(t, p, stop)
	stop()
	t.Logf("stalled writer: %v after %v", err, took)
	if err == nil || !strings.Contains(err.Error(), p) {
		t.Errorf("got %v, want an error naming %s", err, p)
	}
}

// TestPipeWithWriter: a pipe written by a writer that is there at once,
// or comes within the bound, loads; one whose writer writes nothing is
// empty, not a timeout.
func TestPipeWithWriter(t *testing.T) {
	for _, delay := range []time.Duration{0, pipeTestWait / 5} {
		p := mkfifo(t)
		errc := writePipe(p, delay, pipeTestConfig)
		f, took, err := loadPipe(t, p, nil)
		if err != nil || f.Worker == nil || f.Worker.CacheTransceiver == nil || f.Worker.CacheTransceiver.Backend != BackendTCP {
			t.Errorf("writer after %v: %+v, %v", delay, f, err)
		}
		if werr := <-errc; werr != nil {
			t.Errorf("writer after %v: %v", delay, werr)
		}
		t.Logf("writer after %v: loaded in %v", delay, took)
	}
	p := mkfifo(t)
	errc := writePipe(p, 0, "")
	_, _, err := loadPipe(t, p, nil)
	if err == nil || !strings.Contains(err.Error(), "is empty") {
		t.Errorf("writer of nothing: %v, want is empty", err)
	}
	<-errc
}

// TestPipeTooLarge: a pipe is read up to MaxFileSize, as a file is, and
// closed: its writer, with more to write than the pipe holds, is not left
// blocked.
func TestPipeTooLarge(t *testing.T) {
	p := mkfifo(t)
	errc := writePipe(p, 0, strings.Repeat("# x\n", 2*MaxFileSize/4))
	_, _, err := loadPipe(t, p, nil)
	if err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("got %v, want larger than %d bytes", err, MaxFileSize)
	}
	select {
	case werr := <-errc:
		t.Logf("the writer: %v", werr)
	case <-time.After(pipeTestSlack):
		t.Fatalf("the writer of a pipe too large is still blocked")
	}
}

// TestHostilePipeSecretFiles: security.secret_file and
// security.etcd.password_file are bounded as a config file is: a named
// pipe nobody writes to fails within the bound, naming it; one with a
// writer is read.
func TestHostilePipeSecretFiles(t *testing.T) {
	secret := strings.Repeat("s", MinSecretBytes)
	for _, tc := range []struct {
		name string
		read func(p string) error
	}{
		{"secret_file", func(p string) error {
			b, _, err := (&Security{SecretFile: p}).loadSecret(Env{}, pipeTestWait)
			if err == nil && string(b) != secret {
				return fmt.Errorf("read %q", b)
			}
			return err
		}},
		{"password_file", func(p string) error {
			pw, err := EtcdClient{PasswordFile: p}.loadPassword(pipeTestWait)
			if err == nil && pw != secret {
				return fmt.Errorf("read %q", pw)
			}
			return err
		}},
	} {
		p := mkfifo(t)
		took, err := readPipeBounded(t, p, nil, func() error { return tc.read(p) })
		t.Logf("%s, no writer: %v after %v", tc.name, err, took)
		if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "named pipe") {
			t.Errorf("%s, no writer: %v, want an error naming %s as a named pipe", tc.name, err, p)
		}
		p = mkfifo(t)
		errc := writePipe(p, 0, secret+"\n")
		if _, err := readPipeBounded(t, p, nil, func() error { return tc.read(p) }); err != nil {
			t.Errorf("%s, with a writer: %v", tc.name, err)
		}
		<-errc
	}
}
