package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// The range used when the ephemeral range cannot be read, and its floor.
const (
	lowest          = 20000
	defaultEphemLow = 32768
	attempts        = 200
)

var (
	mu     sync.Mutex
	handed = map[int]bool{}
)

// ErrNone says that no free port was found.
var ErrNone = errors.New("freeport: no free loopback port below the ephemeral range")

// Port returns a loopback port that was free a moment ago and lies below
// the kernel's ephemeral port range. It is safe for concurrent use.
func Port() (int, error) {
	ps, err := Ports(1)
	if err != nil {
		return 0, err
	}
	return ps[0], nil
}

// Ports returns n distinct ports as Port does.
func Ports(n int) ([]int, error) {
	hi := ephemeralLow() - 1
	mu.Lock()
	defer mu.Unlock()
	out := make([]int, 0, n)
	for try := 0; len(out) < n && try < attempts*n; try++ {
		p := lowest + rand.IntN(hi-lowest+1)
		if handed[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			continue
		}
		ln.Close()
		handed[p] = true
		out = append(out, p)
	}
	if len(out) < n {
		return nil, fmt.Errorf("%w (wanted %d, found %d in %d-%d)", ErrNone, n, len(out), lowest, hi)
	}
	return out, nil
}

// ephemeralLow reads the low end of net.ipv4.ip_local_port_range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return defaultEphemLow
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return defaultEphemLow
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil || lo <= lowest+1000 {
		return defaultEphemLow
	}
	return lo
}
