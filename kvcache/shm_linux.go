//go:build linux

package kvcache

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

// Linux constants the syscall package does not define (it is frozen).
const (
	mfdCloexec      = 0x1       // MFD_CLOEXEC
	mfdAllowSealing = 0x2       // MFD_ALLOW_SEALING
	fAddSeals       = 1024 + 9  // F_ADD_SEALS
	fGetSeals       = 1024 + 10 // F_GET_SEALS
	fSealSeal       = 0x1       // F_SEAL_SEAL
	fSealShrink     = 0x2       // F_SEAL_SHRINK
	fSealGrow       = 0x4       // F_SEAL_GROW
	fSealWrite      = 0x8       // F_SEAL_WRITE
	fSealFutureW    = 0x10      // F_SEAL_FUTURE_WRITE (Linux 5.1)
	tmpfsMagic      = 0x01021994

	mapPopulate = syscall.MAP_POPULATE
)

// sysMemfdCreate returns the number of the memfd_create system call, which
// package syscall knows for only a few architectures.
func sysMemfdCreate() (uintptr, bool) {
	switch runtime.GOARCH {
	case "amd64":
		return 319, true
	case "386":
		return 356, true
	case "arm":
		return 385, true
	case "arm64", "riscv64", "loong64":
		return 279, true
	case "ppc64", "ppc64le":
		return 360, true
	case "s390x":
		return 350, true
	case "mips64", "mips64le":
		return 5314, true
	case "mips", "mipsle":
		return 4354, true
	}
	return 0, false
}

// Allocate creates a sealed memory file of size bytes and maps it shared.
// The returned Arena is a *ShmArena.
func (a ShmAllocator) Allocate(size int) (Arena, error) {
	if err := checkArenaSize(int64(size)); err != nil {
		return nil, err
	}
	name := a.Name
	if name == "" {
		name = "kvxfer"
	}
	f, err := memfdCreate(name)
	if err != nil {
		return nil, err
	}
	var b []byte
	err = control(f, func(fd int) error {
		if err := syscall.Ftruncate(fd, int64(size)); err != nil {
			return fmt.Errorf("kvcache: ftruncate memfd to %d bytes: %w", size, err)
		}
		var err error
		if b, err = mmapShared(fd, size, a.Populate); err != nil {
			return err
		}
		// Sealing the size protects every process that maps the file: a
		// file shrunk under a mapping turns accesses past the new end into
		// SIGBUS, which would kill the mapping process. The future-write
		// seal leaves the mapping just made as the only way to write.
		seals := uintptr(fSealShrink | fSealGrow | fSealSeal)
		if a.PeerReadOnly {
			seals |= fSealFutureW
		}
		if _, _, e := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), fAddSeals, seals); e != 0 {
			syscall.Munmap(b)
			return fmt.Errorf("kvcache: seal memfd: %w", e)
		}
		return nil
	})
	if err != nil {
		f.Close()
		return nil, err
	}
	return &ShmArena{b: b, f: f, size: int64(size)}, nil
}

// MapShared maps the first size bytes of a memory file received from
// another process (the File of a peer's *ShmArena, typically received over
// a Unix socket with SCM_RIGHTS), read-write and shared, so that writes
// through either mapping are visible through the other. The returned Arena
// is a *ShmArena whose File is nil.
//
// MapShared does not take ownership of f: the caller closes it, and may do
// so as soon as MapShared returns, because the mapping does not need the
// descriptor. Close the returned arena to unmap.
//
// The file must be at least size bytes long and sealed against shrinking
// (as ShmAllocator's files are): memory of a file that a peer could shrink
// would fault with SIGBUS on access and kill this process.
func MapShared(f *os.File, size int64) (Arena, error) {
	return mapPeer(f, size, syscall.PROT_READ|syscall.PROT_WRITE)
}

// MapSharedReadOnly is MapShared for reading only: the mapping cannot be
// written, and it works on files sealed against writes (ShmAllocator with
// PeerReadOnly), which MapShared cannot map. The file must be sealed
// against writes (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE) and be the kernel's
// ordinary shared memory (tmpfs; not hugetlbfs, whose pages a peer could
// release under the mapping): then no peer can make a read of the mapping
// fault.
func MapSharedReadOnly(f *os.File, size int64) (Arena, error) {
	return mapPeer(f, size, syscall.PROT_READ)
}

func mapPeer(f *os.File, size int64, prot int) (Arena, error) {
	if f == nil {
		return nil, errors.New("kvcache: map shared memory: nil file")
	}
	if err := checkArenaSize(size); err != nil {
		return nil, err
	}
	var b []byte
	err := control(f, func(fd int) error {
		var st syscall.Stat_t
		if err := syscall.Fstat(fd, &st); err != nil {
			return fmt.Errorf("kvcache: map shared memory: fstat: %w", err)
		}
		if st.Size < size {
			return fmt.Errorf("kvcache: map shared memory: file is %d bytes, want at least %d", st.Size, size)
		}
		seals, _, e := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), fGetSeals, 0)
		if e != 0 {
			return fmt.Errorf("kvcache: map shared memory: file cannot be sealed (not a memfd?): %w", e)
		}
		if seals&fSealShrink == 0 {
			return errors.New("kvcache: map shared memory: file is not sealed against shrinking")
		}
		if prot&syscall.PROT_WRITE == 0 {
			if seals&(fSealWrite|fSealFutureW) == 0 {
				return errors.New("kvcache: map shared memory: file is not sealed against writes")
			}
			var fs syscall.Statfs_t
			if err := syscall.Fstatfs(fd, &fs); err != nil || fs.Type != tmpfsMagic {
				return errors.New("kvcache: map shared memory: file is not in the kernel's shared memory (tmpfs)")
			}
		}
		m, err := syscall.Mmap(fd, 0, int(size), prot, syscall.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("kvcache: mmap %d shared bytes: %w", size, err)
		}
		b = m
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ShmArena{b: b, size: size}, nil
}

func memfdCreate(name string) (*os.File, error) {
	nr, ok := sysMemfdCreate()
	if !ok {
		return nil, fmt.Errorf("kvcache: memfd_create: unknown system call number on %s: %w", runtime.GOARCH, errors.ErrUnsupported)
	}
	p, err := syscall.BytePtrFromString(name)
	if err != nil {
		return nil, fmt.Errorf("kvcache: memfd name %q: %w", name, err)
	}
	fd, _, e := syscall.Syscall(nr, uintptr(unsafe.Pointer(p)), mfdCloexec|mfdAllowSealing, 0)
	if e != 0 {
		return nil, fmt.Errorf("kvcache: memfd_create %q: %w", name, e)
	}
	return os.NewFile(fd, "memfd:"+name), nil
}

func mmapShared(fd, size int, populate bool) ([]byte, error) {
	flags := syscall.MAP_SHARED
	if populate {
		flags |= mapPopulate
	}
	b, err := syscall.Mmap(fd, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, flags)
	if err != nil {
		return nil, fmt.Errorf("kvcache: mmap %d shared bytes: %w", size, err)
	}
	return b, nil
}

// control runs fn with f's descriptor, without the side effects of f.Fd
// (which switches the file to blocking mode), and keeps f open meanwhile.
func control(f *os.File, fn func(fd int) error) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return fmt.Errorf("kvcache: %w", err)
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil {
		return fmt.Errorf("kvcache: %w", err)
	}
	return ferr
}
