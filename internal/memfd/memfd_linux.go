//go:build linux

package memfd

import (
	"errors"
	"fmt"
	"math"
	"os"

	"golang.org/x/sys/unix"
)

// Seals of a memory file (fcntl F_ADD_SEALS, F_GET_SEALS).
const (
	SealSeal        = unix.F_SEAL_SEAL         // no more seals
	SealShrink      = unix.F_SEAL_SHRINK       // the size cannot shrink
	SealGrow        = unix.F_SEAL_GROW         // the size cannot grow
	SealWrite       = unix.F_SEAL_WRITE        // no writes at all
	SealFutureWrite = unix.F_SEAL_FUTURE_WRITE // no writes but through mappings that exist (Linux 5.1)
)

// Create returns a new, empty memory file (memfd_create with MFD_CLOEXEC and
// MFD_ALLOW_SEALING). name labels it in /proc/<pid>/maps and /proc/<pid>/fd
// (as "/memfd:<name>"); it has no other meaning.
func Create(name string) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd: create %q: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "memfd:"+name), nil
}

// AddSeals adds seals (Seal* bits) to f.
func AddSeals(f *os.File, seals int) error {
	return control(f, func(fd int) error {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			return fmt.Errorf("memfd: seal: %w", err)
		}
		return nil
	})
}

// Seals returns the seals (Seal* bits) of f. A file that cannot be sealed
// (not a memory file) is an error.
func Seals(f *os.File) (int, error) {
	var seals int
	err := control(f, func(fd int) error {
		var err error
		seals, err = getSeals(fd)
		return err
	})
	return seals, err
}

func getSeals(fd int) (int, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return 0, fmt.Errorf("memfd: file cannot be sealed (not a memfd?): %w", err)
	}
	return seals, nil
}

// IsShmem reports whether fd is a file of the kernel's ordinary shared
// memory (tmpfs, which memfd_create's files are on): not hugetlbfs, whose
// reservations a peer can release under a mapping, nor anything a peer
// could make a read of block or fault.
func IsShmem(fd int) bool {
	var fs unix.Statfs_t
	return unix.Fstatfs(fd, &fs) == nil && fs.Type == unix.TMPFS_MAGIC
}

// New creates a memory file of size bytes, maps it shared and writable,
// and seals it against shrinking, growing and further seals (and writes,
// with o.PeerReadOnly), so that every process that maps it is safe from
// SIGBUS. The Mapping owns the file.
func New(name string, size int, o Options) (*Mapping, error) {
	if size <= 0 {
		return nil, fmt.Errorf("memfd: size %d out of range", size)
	}
	f, err := Create(name)
	if err != nil {
		return nil, err
	}
	var b []byte
	err = control(f, func(fd int) error {
		if err := unix.Ftruncate(fd, int64(size)); err != nil {
			return fmt.Errorf("memfd: ftruncate to %d bytes: %w", size, err)
		}
		flags := unix.MAP_SHARED
		if o.Populate {
			flags |= unix.MAP_POPULATE
		}
		var err error
		if b, err = unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags); err != nil {
			return fmt.Errorf("memfd: mmap %d shared bytes: %w", size, err)
		}
		// The future-write seal leaves the mapping just made as the only
		// way to write.
		seals := SealShrink | SealGrow | SealSeal
		if o.PeerReadOnly {
			seals |= SealFutureWrite
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
			unix.Munmap(b)
			return fmt.Errorf("memfd: seal: %w", err)
		}
		return nil
	})
	if err != nil {
		f.Close()
		return nil, err
	}
	return &Mapping{b: b, f: f, size: int64(size)}, nil
}

// Map maps the first size bytes of a memory file from another process (the
// File of its Mapping, typically received over a Unix socket with
// SCM_RIGHTS), read-write and shared, so that writes through either mapping
// are visible through the other. The file must be at least size bytes long
// and sealed against shrinking (as New's files are): memory of a file that
// a peer could shrink would fault with SIGBUS on access and kill this
// process.
//
// Map does not take ownership of f: the caller closes it, and may do so as
// soon as Map returns, because the mapping does not need the descriptor.
func Map(f *os.File, size int64) (*Mapping, error) {
	return mapPeer(f, size, unix.PROT_READ|unix.PROT_WRITE)
}

// MapReadOnly is Map for reading only: the mapping cannot be written, and
// it works on files sealed against writes (New with PeerReadOnly), which
// Map cannot map. The file must also be sealed against writes (SealWrite or
// SealFutureWrite) and be on tmpfs (IsShmem): then no peer can change what
// the mapping reads, nor make a read of it fault.
func MapReadOnly(f *os.File, size int64) (*Mapping, error) {
	return mapPeer(f, size, unix.PROT_READ)
}

func mapPeer(f *os.File, size int64, prot int) (*Mapping, error) {
	if f == nil {
		return nil, errors.New("memfd: nil file")
	}
	if size <= 0 || size > math.MaxInt {
		return nil, fmt.Errorf("memfd: size %d out of range", size)
	}
	var b []byte
	err := control(f, func(fd int) error {
		if err := checkPeer(fd, size, prot&unix.PROT_WRITE == 0); err != nil {
			return err
		}
		var err error
		if b, err = unix.Mmap(fd, 0, int(size), prot, unix.MAP_SHARED); err != nil {
			return fmt.Errorf("memfd: mmap %d shared bytes: %w", size, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &Mapping{b: b, size: size}, nil
}

// checkPeer checks that a peer's file fd can be mapped for size bytes
// without risk: long enough, sealed against shrinking, and for a read-only
// mapping sealed against writes and on tmpfs.
func checkPeer(fd int, size int64, readOnly bool) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("memfd: fstat: %w", err)
	}
	if st.Size < size {
		return fmt.Errorf("memfd: file is %d bytes, want at least %d", st.Size, size)
	}
	seals, err := getSeals(fd)
	if err != nil {
		return err
	}
	if seals&SealShrink == 0 {
		return errors.New("memfd: file is not sealed against shrinking")
	}
	if !readOnly {
		return nil
	}
	if seals&(SealWrite|SealFutureWrite) == 0 {
		return errors.New("memfd: file is not sealed against writes")
	}
	if !IsShmem(fd) {
		return errors.New("memfd: file is not in the kernel's shared memory (tmpfs)")
	}
	return nil
}

// unmap unmaps b, a slice unix.Mmap returned.
func unmap(b []byte) error {
	if err := unix.Munmap(b); err != nil {
		return fmt.Errorf("memfd: munmap: %w", err)
	}
	return nil
}

// control runs fn with f's descriptor, without the side effects of f.Fd
// (which switches the file to blocking mode), and keeps f open meanwhile.
func control(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("memfd: %w", err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return fmt.Errorf("memfd: %w", err)
	}
	return ferr
}
