package config

import (
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The decoders of values a user writes, beside the file's (FuzzLoad): each
// never panics, and what it accepts it accepts again in the form it gives
// back.

// FuzzParseByteSize: a size that parses is not negative, and its byte
// count parses to itself.
func FuzzParseByteSize(f *testing.F) {
	for _, s := range []string{"512MB", "1GB", "0B", "1 KiB", "9223372036854775807", "8589934592GB", "-1", "1.5GB", " 7 mb "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseByteSize(s)
		if err != nil {
			return
		}
		if n < 0 {
			t.Fatalf("ParseByteSize(%q) = %d", s, n)
		}
		if m, err := ParseByteSize(strconv.FormatInt(n, 10)); err != nil || m != n {
			t.Fatalf("ParseByteSize(%q) = %d, but %d parses to %d, %v", s, n, n, m, err)
		}
	})
}

// FuzzParseClusterURI: a cluster_uri that parses writes back (String) to
// one that parses to the same.
func FuzzParseClusterURI(f *testing.F) {
	for _, s := range []string{"etcd://127.0.0.1:2379", "etcd://h1:2379,etcd://h2:2379", "etcd://[::1]:2379", "http://router:8000/",
		"https://r:8443", "http://u@r:80", "etcd://h:2379,", "etcd:// h:1 , h:2 "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		u, err := ParseClusterURI(s)
		if err != nil {
			return
		}
		if len(u.Endpoints) == 0 || len(u.Endpoints) > MaxClusterEndpoints {
			t.Fatalf("ParseClusterURI(%q) = %v", s, u)
		}
		v, err := ParseClusterURI(u.String())
		if err != nil || v.Scheme != u.Scheme || !slices.Equal(v.Endpoints, u.Endpoints) {
			t.Fatalf("ParseClusterURI(%q) = %v, whose String %q parses to %v, %v", s, u, u.String(), v, err)
		}
	})
}

// FuzzParsePeerHost: the canonical form of an allowed peer host is its own
// canonical form.
func FuzzParsePeerHost(f *testing.F) {
	for _, s := range []string{"10.0.0.1", "[::1]", "10.1.2.3/8", "::ffff:10.0.0.1", "Host.Example.", "fe80::1%eth0", "h:80", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c, err := ParsePeerHost(s)
		if err != nil {
			return
		}
		if d, err := ParsePeerHost(c); err != nil || d != c {
			t.Fatalf("ParsePeerHost(%q) = %q, which parses to %q, %v", s, c, d, err)
		}
	})
}

// FuzzParseSecret: a secret that is accepted has at least MinSecretBytes
// bytes; the error of one that is not never quotes it.
func FuzzParseSecret(f *testing.F) {
	for _, s := range []string{strings.Repeat("ab", 32), strings.Repeat("x", 40), " \n", "zz" + strings.Repeat("0", 62)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := parseSecret(s)
		if err == nil && len(b) < MinSecretBytes {
			t.Fatalf("parseSecret(%q) = %d bytes", s, len(b))
		}
		if err != nil && len(strings.TrimSpace(s)) >= 4 && strings.Contains(err.Error(), strings.TrimSpace(s)) {
			t.Fatalf("parseSecret's error quotes the secret: %v", err)
		}
	})
}

// FuzzEnv: whatever values the transfer path's variables hold, a worker
// file loads or fails without a panic, and each error names the variable or
// the file.
func FuzzEnv(f *testing.F) {
	f.Add("1", "512MB", "4", "1", "0", "eth0")
	f.Add("true", "1.5GB", "-1", "yes", "2", "")
	f.Fuzz(func(t *testing.T, concurrent, buffer, count, ucx, zcopy, iface string) {
		env := EnvFromMap(map[string]string{EnvRequestConcurrent: concurrent, EnvTransferBuffer: buffer, EnvRecvBufferCount: count,
			EnvSendConcurrency: count, EnvUseUCX: ucx, EnvTryZeroCopy: zcopy, EnvUCXInterface: iface}).WithInterfaces("lo", "eth0")
		_, err := LoadBytes("w.yaml", []byte("cache_transceiver_config: {backend: DEFAULT}\n"), env)
		if err == nil {
			return
		}
		for _, line := range strings.Split(err.Error(), "\n") {
			if !strings.HasPrefix(line, "w.yaml") && !strings.HasPrefix(line, "env TRTLLM_") {
				t.Fatalf("error line naming neither the file nor a variable: %q", line)
			}
		}
	})
}
