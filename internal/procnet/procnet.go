package procnet

import (
	"bufio"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// stateListen is TCP_LISTEN in the "st" column of /proc/net/tcp.
const stateListen = "0A"

// Listener is one TCP socket in the LISTEN state.
type Listener struct {
	Addr  netip.AddrPort // the bound address (0.0.0.0 or :: for any)
	Inode uint64         // the socket's inode
}

// Listening returns the TCP sockets in the LISTEN state that process pid
// holds a descriptor of (pid 0: this process), sorted by address. It reads
// the tables of pid's network namespace.
func Listening(pid int) ([]Listener, error) {
	dir := "/proc/self"
	if pid != 0 {
		dir = "/proc/" + strconv.Itoa(pid)
	}
	inodes, err := socketInodes(filepath.Join(dir, "fd"))
	if err != nil {
		return nil, err
	}
	var out []Listener
	for _, table := range []string{"tcp", "tcp6"} {
		ls, err := readTable(filepath.Join(dir, "net", table))
		if errors.Is(err, os.ErrNotExist) && table == "tcp6" {
			continue // a kernel without IPv6
		}
		if err != nil {
			return nil, err
		}
		for _, l := range ls {
			if inodes[l.Inode] {
				out = append(out, l)
			}
		}
	}
	slices.SortFunc(out, func(a, b Listener) int { return a.Addr.Compare(b.Addr) })
	return out, nil
}

// socketInodes returns the inodes of the sockets among the descriptors
// listed in dir (links "socket:[N]").
func socketInodes(dir string) (map[uint64]bool, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("procnet: %w", err)
	}
	inodes := map[uint64]bool{}
	for _, e := range ents {
		link, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed since ReadDir
		}
		if s, ok := strings.CutPrefix(link, "socket:["); ok {
			if n, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
				inodes[n] = true
			}
		}
	}
	return inodes, nil
}

// readTable returns the listening sockets of one /proc/net/tcp{,6} file.
func readTable(path string) ([]Listener, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("procnet: %w", err)
	}
	defer f.Close()
	var out []Listener
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		fields := strings.Fields(sc.Text())
		if line == 1 || len(fields) < 10 || fields[3] != stateListen {
			continue // the header, or not a listener
		}
		ap, err := ParseAddr(fields[1])
		if err != nil {
			return nil, fmt.Errorf("procnet: %s:%d: %w", path, line, err)
		}
		inode, err := strconv.ParseUint(fields[9], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("procnet: %s:%d: inode %q: %w", path, line, fields[9], err)
		}
		out = append(out, Listener{Addr: ap, Inode: inode})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("procnet: %s: %w", path, err)
	}
	return out, nil
}

// ParseAddr parses an address of /proc/net/tcp{,6}: the IP in hex as the
// kernel stores it (each 32-bit word in host byte order, little-endian
// here), a colon, the port in hex.
func ParseAddr(s string) (netip.AddrPort, error) {
	h, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("address %q: no port", s)
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: port: %w", s, err)
	}
	b, err := hex.DecodeString(h)
	if err != nil || (len(b) != 4 && len(b) != 16) {
		return netip.AddrPort{}, fmt.Errorf("address %q: want 8 or 32 hex digits", s)
	}
	for i := 0; i < len(b); i += 4 { // little-endian words
		b[i], b[i+1], b[i+2], b[i+3] = b[i+3], b[i+2], b[i+1], b[i]
	}
	ip, _ := netip.AddrFromSlice(b)
	return netip.AddrPortFrom(ip, uint16(port)), nil
}
