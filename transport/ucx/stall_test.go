//go:build ucx && cgo

package ucx

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// pause stops the peer process (SIGSTOP), as a receiver that stalls (a
// paused process, a machine swapping) would be, and waits until the
// kernel says it is stopped (the signal is delivered when its threads
// next run). It is continued at the end of t at the latest.
func (p *peerProc) pause(t *testing.T) {
	t.Helper()
	pid := p.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
	stat := fmt.Sprintf("/proc/%d/stat", pid)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		b, err := os.ReadFile(stat)
		if _, rest, ok := bytes.Cut(b, []byte(") ")); err == nil && ok && len(rest) > 0 && rest[0] == 'T' {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the peer did not stop within 5 s")
		}
	}
}

// TestAbortReachesStalledReceiver: a Send that times out while its
// receiver process is paused for longer than the Send's wait for an ACK
// still fails the receipt once the receiver runs again (the peer's
// receipts have no deadline of their own), Send returns within its bound,
// and the next transfer works. First contact (no endpoint yet) and a
// connected pair alike, with the default transports and over tcp.
func TestAbortReachesStalledReceiver(t *testing.T) {
	for _, tc := range []struct {
		tls       string
		connected bool
	}{{"", false}, {"", true}, {"tcp", false}, {"tcp", true}} {
		t.Run(fmt.Sprintf("UCX_TLS=%s/connected=%v", tc.tls, tc.connected), func(t *testing.T) {
			var env []string
			if tc.tls != "" {
				t.Setenv("UCX_TLS", tc.tls)
				env = append(env, "UCX_TLS="+tc.tls)
			}
			p := startPeer(t, env...)
			a := open(t)
			defer a.Close()
			if tc.connected {
				roundTripPeer(t, a, p)
			}
			const n = 1 << 20
			p.cmdf(t, "recv %d", n)
			desc, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(p.expect(t, "desc "), "desc "))
			p.pause(t)
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			res := make(chan error, 1)
			go func() { res <- a.Send(ctx, desc, [][]byte{make([]byte, n)}) }()
			var err error
			select {
			case err = <-res:
			case <-time.After(10 * time.Second):
				syscall.Kill(p.cmd.Process.Pid, syscall.SIGCONT)
				t.Fatal("Send to a paused receiver did not return within 10 s")
			}
			t.Logf("Send: %v", err)
			var te *transport.TimeoutError
			if err != nil && !errors.As(err, &te) && !errors.Is(err, transport.ErrPeerLost) {
				t.Errorf("Send = %v, want a TimeoutError or ErrPeerLost", err)
			}
			time.Sleep(3 * time.Second) // past the Send's 2 s bound
			if err := syscall.Kill(p.cmd.Process.Pid, syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			select {
			case l, ok := <-p.lines:
				if !ok {
					t.Fatal("peer exited")
				}
				t.Logf("peer: %s", l)
				if err == nil && l != "got ok "+fmt.Sprint(hashOf(make([]byte, n))) {
					t.Errorf("Send returned nil, receipt: %s", l)
				}
				if err != nil && !strings.HasPrefix(l, "got err") {
					t.Errorf("Send failed (%v), receipt: %s", err, l)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("receipt of the timed-out Send still armed 10 s after its receiver ran again")
			}
			roundTripPeer(t, a, p)
		})
	}
}

// hashOf is the peer's hash of what it received ("got ok <hash>").
func hashOf(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}
