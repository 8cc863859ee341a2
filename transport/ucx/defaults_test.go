//go:build ucx && cgo

package ucx

import (
	"os"
	"strings"
	"testing"
	"time"
)

// TestDefaultsFromEnv: each default is given to UCX only when no variable
// that sets it is in the environment and UCX_TLS lets its transport in.
func TestDefaultsFromEnv(t *testing.T) {
	vars := []string{"UCX_TLS", "UCX_MM_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_POSIX_ERROR_HANDLING",
		"UCX_CMA_MEMORY_INVALIDATE", "UCX_KEEPALIVE_INTERVAL", "UCX_TCP_RX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE", "UCX_NET_DEVICES"}
	all := []string{"MM_ERROR_HANDLING=y", "MEMORY_INVALIDATE=y", "KEEPALIVE_INTERVAL=1s", "RX_SEG_SIZE=1M"}
	for _, c := range []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"nothing set", nil, all},
		{"tcp only", map[string]string{"UCX_TLS": "tcp"}, []string{"KEEPALIVE_INTERVAL=1s", "RX_SEG_SIZE=1M"}},
		{"shared memory only", map[string]string{"UCX_TLS": "sm"}, []string{"MM_ERROR_HANDLING=y", "MEMORY_INVALIDATE=y", "KEEPALIVE_INTERVAL=1s"}},
		{"exclusion", map[string]string{"UCX_TLS": "^cma"}, all},
		{"rx set", map[string]string{"UCX_TCP_RX_SEG_SIZE": "64K"}, all[:3]},
		{"tx set", map[string]string{"UCX_TCP_TX_SEG_SIZE": "2M"}, all[:3]},
		{"sysv error handling set", map[string]string{"UCX_SYSV_ERROR_HANDLING": "n"}, all[1:]},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, v := range vars {
				t.Setenv(v, "") // restored after the test
				os.Unsetenv(v)
			}
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			got := strings.Split(strings.TrimSuffix(defaultsFromEnv(binding{}), "\x00"), "\x00")
			if strings.Join(got, " ") != strings.Join(c.want, " ") {
				t.Fatalf("defaults %q, want %q", got, c.want)
			}
		})
	}
}

func TestKeepSpinning(t *testing.T) {
	for _, tc := range []struct {
		inFlight, overTCP bool
		since             time.Duration
		want              bool
	}{
		{true, false, 0, true},
		{true, false, spinFor - time.Microsecond, true},
		{true, false, spinFor, false}, // spun long enough
		{false, false, 0, false},      // nothing in flight: sleep
		{true, true, 0, false},        // tcp: sleep
		{false, true, time.Hour, false},
	} {
		if got := keepSpinning(tc.inFlight, tc.overTCP, tc.since); got != tc.want {
			t.Errorf("keepSpinning(%v, %v, %v) = %v, want %v", tc.inFlight, tc.overTCP, tc.since, got, tc.want)
		}
	}
}
