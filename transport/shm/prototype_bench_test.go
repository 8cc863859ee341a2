//go:build linux

package shm

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/hugepage"
)

// The vmsplice prototype: a child process (the test binary with
// childEnv=spliceRole) vmsplices its memory into pipes whose read ends the
// parent holds, and the parent read()s straight into its destination: one
// copy, the kernel's. Its environment: childSizeEnv (bytes), spliceTHPEnv
// ("1": the source is advised to huge pages), splicePipesEnv (the number of
// pipes, fds 3.., each carrying an equal share of every round).
const (
	spliceRole     = "vmsplice"
	spliceTHPEnv   = "KVXFER_SHM_SPLICE_THP"
	splicePipesEnv = "KVXFER_SHM_SPLICE_PIPES"
)

// alignedAnon maps n bytes of private anonymous memory starting at a huge
// page boundary, advised to huge pages when thp is set; it returns the
// memory and a function that unmaps it.
func alignedAnon(n int, thp bool) ([]byte, func(), error) {
	raw, err := unix.Mmap(-1, 0, n+hugepage.Size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, err
	}
	off := int(-uintptr(unsafe.Pointer(&raw[0])) & (hugepage.Size - 1))
	mem := raw[off : off+n : off+n]
	if thp {
		if _, err := hugepage.Advise(mem); err != nil {
			unix.Munmap(raw)
			return nil, nil, err
		}
	} else if err := unix.Madvise(mem, unix.MADV_NOHUGEPAGE); err != nil {
		unix.Munmap(raw)
		return nil, nil, err
	}
	return mem, func() { unix.Munmap(raw) }, nil
}

// spliceChildMain runs the splicing child: it fills its source, prints
// "READY <bytes backed by huge pages>", then for each line on stdin
// vmsplices the whole source (share i of it into pipe i, in pipe-sized
// pieces, one goroutine per pipe) and prints nothing; it ends at EOF.
func spliceChildMain() int {
	n, _ := strconv.Atoi(os.Getenv(childSizeEnv))
	pipes, _ := strconv.Atoi(os.Getenv(splicePipesEnv))
	src, free, err := alignedAnon(n, os.Getenv(spliceTHPEnv) == "1")
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer free()
	fill(src, 42)
	backed, _ := hugepage.Backed(src)
	fmt.Printf("READY %d\n", backed)
	in := bufio.NewReader(os.Stdin)
	share := n / pipes
	for rounds := 0; ; rounds++ {
		if _, err := in.ReadString('\n'); err != nil {
			// Pages referenced by a pipe are neither split nor moved:
			// the source stays in huge pages.
			after, _ := hugepage.Backed(src)
			fmt.Fprintf(os.Stderr, "vmsplice child: %d rounds; huge pages before %d, after %d bytes\n", rounds, backed, after)
			return 0
		}
		var wg sync.WaitGroup
		for p := range pipes {
			wg.Go(func() {
				if err := vmspliceAll(3+p, src[p*share:(p+1)*share]); err != nil {
					fmt.Fprintln(os.Stderr, "child: vmsplice:", err)
					os.Exit(1)
				}
			})
		}
		wg.Wait()
	}
}

// vmspliceAll vmsplices all of b into the pipe fd, blocking while it is
// full.
func vmspliceAll(fd int, b []byte) error {
	for len(b) > 0 {
		iov := []unix.Iovec{{Base: &b[0]}}
		iov[0].SetLen(len(b))
		k, err := unix.Vmsplice(fd, iov, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[k:]
	}
	return nil
}

// BenchmarkVmsplice: 512 MiB from another process's memory into this one's,
// by vmsplice into a pipe and read() out of it (one copy, done by the
// kernel in the reader), next to a plain copy of the same bytes in the same
// run. Sub-benchmarks name the source's pages (thp: advised to 2 MiB pages,
// 4k: not), the pipe's size and the number of pipes (one reading goroutine
// each). The child says on stderr how much of its source was in huge pages
// before and after. It is the measurement behind the package
// documentation's "Why not one copy".
func BenchmarkVmsplice(b *testing.B) {
	const n = 512 << 20
	dst, free, err := alignedAnon(n, true)
	if err != nil {
		b.Fatal(err)
	}
	defer free()
	src, free2, err := alignedAnon(n, true)
	if err != nil {
		b.Fatal(err)
	}
	defer free2()
	fill(src, 42)
	copy(dst, src) // fault the pages in
	b.Run("copy", func(b *testing.B) {
		b.SetBytes(n)
		for b.Loop() {
			copy(dst, src)
		}
	})
	for _, sub := range []struct {
		thp          bool
		pipeSz, nrPp int
		readLen      int
	}{
		{true, 1 << 20, 1, 1 << 20}, {false, 1 << 20, 1, 1 << 20},
		{true, 256 << 10, 1, 256 << 10}, {true, 1 << 20, 2, 1 << 20},
	} {
		pages := "4k"
		if sub.thp {
			pages = "thp"
		}
		name := fmt.Sprintf("vmsplice-%s-pipe%dK-x%d", pages, sub.pipeSz>>10, sub.nrPp)
		b.Run(name, func(b *testing.B) {
			clear(dst)
			round := spliceChild(b, n, sub.thp, sub.pipeSz, sub.nrPp, dst, sub.readLen)
			round() // untimed: the child faults nothing more after this
			b.SetBytes(n)
			for b.Loop() {
				round()
			}
			if string(dst[:4096]) != string(src[:4096]) || string(dst[n-4096:]) != string(src[n-4096:]) {
				b.Fatal("bytes differ")
			}
		})
	}
}

// spliceChild starts the splicing child with nPipes pipes of pipeSz bytes
// and returns a function that asks it for one round and reads the round
// into dst, readLen bytes per read.
func spliceChild(b *testing.B, n int, thp bool, pipeSz, nPipes int, dst []byte, readLen int) func() {
	var rds []*os.File
	var wrs []*os.File
	for range nPipes {
		r, w, err := os.Pipe()
		if err != nil {
			b.Fatal(err)
		}
		if _, err := unix.FcntlInt(w.Fd(), unix.F_SETPIPE_SZ, pipeSz); err != nil {
			b.Fatal(err)
		}
		rds, wrs = append(rds, r), append(wrs, w)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	thpFlag := "0"
	if thp {
		thpFlag = "1"
	}
	cmd.Env = append(os.Environ(), childEnv+"="+spliceRole, childSizeEnv+"="+strconv.Itoa(n),
		spliceTHPEnv+"="+thpFlag, splicePipesEnv+"="+strconv.Itoa(nPipes))
	cmd.ExtraFiles = wrs
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	for _, w := range wrs {
		w.Close()
	}
	b.Cleanup(func() {
		stdin.Close()
		cmd.Wait()
		for _, r := range rds {
			r.Close()
		}
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		b.Fatalf("child: %v", err)
	}
	b.Logf("child: %s", line)
	share := n / nPipes
	return func() {
		if _, err := io.WriteString(stdin, "go\n"); err != nil {
			b.Fatal(err)
		}
		var wg sync.WaitGroup
		for p, r := range rds {
			wg.Go(func() {
				d := dst[p*share : (p+1)*share]
				fd := int(r.Fd())
				for off := 0; off < len(d); {
					k, err := syscall.Read(fd, d[off:min(off+readLen, len(d))])
					if err == syscall.EINTR {
						continue
					}
					if err != nil || k == 0 {
						panic(fmt.Sprintf("read pipe: %d, %v", k, err))
					}
					off += k
				}
			})
		}
		wg.Wait()
	}
}

// pingRole is the child of BenchmarkSocketPingPong: it answers each 8-byte
// message on the Unix socket at fd 3 with the same 8 bytes, through Go's
// poller (net.FileConn) or with blocking system calls on the raw
// descriptor, as childSizeEnv says ("1": raw).
const pingRole = "sockping"

// pingChildMain runs the child of BenchmarkSocketPingPong until the
// socket ends.
func pingChildMain() int {
	var buf [8]byte
	if os.Getenv(childSizeEnv) == "1" {
		for {
			if _, err := io.ReadFull(rawFd(3), buf[:]); err != nil {
				return 0
			}
			if _, err := unix.Write(3, buf[:]); err != nil {
				return 1
			}
		}
	}
	c, err := net.FileConn(os.NewFile(3, "ping"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	for {
		if _, err := io.ReadFull(c, buf[:]); err != nil {
			return 0
		}
		if _, err := c.Write(buf[:]); err != nil {
			return 1
		}
	}
}

// rawFd reads a descriptor with blocking read(2) calls.
type rawFd int

func (fd rawFd) Read(p []byte) (int, error) {
	for {
		n, err := unix.Read(int(fd), p)
		if err == unix.EINTR {
			continue
		}
		if n == 0 && err == nil {
			return 0, io.EOF
		}
		return n, err
	}
}

// BenchmarkSocketPingPong: an 8-byte message to a child process and back
// over a Unix socket pair, the transport's kind of wake-up, both ends
// through Go's poller (netpoll: a read that finds nothing parks the
// goroutine, and the poller's thread is woken by epoll) or both with
// blocking read(2) on the raw descriptor (raw: the reading thread sleeps
// in the kernel and is woken directly). It says what taking the data
// plane's sockets off the poller could save per hop.
func BenchmarkSocketPingPong(b *testing.B) {
	for _, mode := range []string{"netpoll", "raw"} {
		b.Run(mode, func(b *testing.B) {
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				b.Fatal(err)
			}
			theirs := os.NewFile(uintptr(fds[1]), "ping child")
			raw := "0"
			if mode == "raw" {
				raw = "1"
			}
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), childEnv+"="+pingRole, childSizeEnv+"="+raw)
			cmd.ExtraFiles = []*os.File{theirs}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			theirs.Close()
			var rw io.ReadWriter
			var closeMine func()
			if mode == "raw" {
				rw = struct {
					io.Reader
					io.Writer
				}{rawFd(fds[0]), rawWriter(fds[0])}
				closeMine = func() { unix.Close(fds[0]) }
			} else {
				c, err := net.FileConn(os.NewFile(uintptr(fds[0]), "ping"))
				if err != nil {
					b.Fatal(err)
				}
				unix.Close(fds[0]) // FileConn holds a duplicate
				rw, closeMine = c, func() { c.Close() }
			}
			defer func() {
				closeMine()
				cmd.Wait()
			}()
			var buf [8]byte
			for b.Loop() {
				if _, err := rw.Write(buf[:]); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(rw, buf[:]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// rawWriter writes a descriptor with blocking write(2) calls.
type rawWriter int

func (fd rawWriter) Write(p []byte) (int, error) { return unix.Write(int(fd), p) }
