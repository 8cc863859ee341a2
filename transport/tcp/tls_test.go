package tcp

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/syncbuf"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/transport"
	"github.com/kvxfer/kvxfer/transport/transporttest"
)

// testCA is one cluster CA for the tests of this file; parties are cheap.
var testCA = sync.OnceValue(func() *tlsconf.Authority {
	a, err := tlsconf.NewAuthority("tcp test CA", time.Hour)
	if err != nil {
		panic(err)
	}
	return a
})

// party returns the mutual TLS of a new member of ca's cluster.
func party(t testing.TB, ca *tlsconf.Authority, name string) *transport.TLSConfig {
	t.Helper()
	c, err := ca.Party(name, nil, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &transport.TLSConfig{Server: c.Server, Client: c.Client}
}

func TestConformanceTLS(t *testing.T) {
	a, b := party(t, testCA(), "a"), party(t, testCA(), "b")
	transporttest.RunOptions(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return open(t, transport.Options{TLS: a}), open(t, transport.Options{TLS: b})
	}, transporttest.Options{SkipLarge: true}) // 64 MiB is 4,096 TLS records
}

// waitLog waits until the log holds s.
func waitLog(t *testing.T, l *syncbuf.Buffer, s string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(l.String(), s) {
		if time.Now().After(deadline) {
			t.Fatalf("log does not contain %q after 5s:\n%s", s, l.String())
		}
		time.Sleep(5 * time.Millisecond) // polling a log: no event to wait on
	}
}

// moveOne sends 1 MiB from tx to rx and fails t unless it arrives intact.
func moveOne(t *testing.T, tx, rx *Transport) {
	t.Helper()
	src := make([]byte, 1<<20)
	for i := range src {
		src[i] = byte(i * 7)
	}
	dst := make([]byte, len(src))
	r, err := rx.Expect([][]byte{dst})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tx.Send(ctx, r.Descriptor(), [][]byte{src}); err != nil {
		t.Fatalf("Send: %v", err)
	}
	within(t, 10*time.Second, "receipt", func() { <-r.Done() })
	if err := r.Err(); err != nil || !bytes.Equal(src, dst) {
		t.Fatalf("receipt: err %v, intact %v", err, bytes.Equal(src, dst))
	}
}

// TestTLSRefusals: a TLS receiver refuses, with a log line that says why, a
// client without a certificate, one with a certificate of another CA and a
// plain TCP one, and keeps serving members of its cluster.
func TestTLSRefusals(t *testing.T) {
	ca := testCA()
	other, err := tlsconf.NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncbuf.Buffer
	rxTLS := party(t, ca, "rx")
	closeLogEvery = 0 // every case's refusal logged at once, not a line a second
	rx := open(t, transport.Options{TLS: rxTLS, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	closeLogEvery = time.Second
	member := open(t, transport.Options{TLS: party(t, ca, "tx")})
	if rx.Name() != "tcp(tls)" {
		t.Errorf("Name = %q, want tcp(tls)", rx.Name())
	}

	good := party(t, ca, "c")
	noCert := good.Client.Clone()
	noCert.Certificates = nil
	stranger := good.Client.Clone() // trusts our CA, but is not of it
	stranger.Certificates = nil
	strangerCert := party(t, other, "s").Client.Certificates[0]
	stranger.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &strangerCert, nil // sent although the receiver asks for its CA
	}
	cases := []struct {
		name   string
		client *tls.Config
		log    string // in the receiver's log
	}{
		{"no client certificate", noCert, "client didn't provide a certificate"},
		{"client certificate of another CA", stranger, "certificate signed by unknown authority"},
		{"plain TCP", nil, "first record does not look like a TLS handshake"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := strings.Count(logs.String(), "TLS handshake failed")
			nc, err := net.Dial("tcp", rx.Endpoint())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			nc.SetDeadline(time.Now().Add(5 * time.Second))
			var pre [prefaceLen]byte
			putPreface(pre[:], 42)
			c := nc
			if tc.client != nil {
				cfg := tc.client.Clone()
				cfg.ServerName = "127.0.0.1"
				c = tls.Client(nc, cfg)
			}
			c.Write(pre[:]) // TLS 1.3: the client learns of a refusal on its next read
			var b [1]byte
			_, rerr := c.Read(b[:])
			if rerr == nil {
				t.Fatal("the receiver wrote to an unauthenticated client")
			}
			if tc.client != nil && !strings.Contains(rerr.Error(), "tls:") {
				t.Errorf("client read: %v, want a TLS alert", rerr)
			}
			deadline := time.Now().Add(5 * time.Second)
			for strings.Count(logs.String(), "TLS handshake failed") == before {
				if time.Now().After(deadline) {
					t.Fatalf("no log line for the refusal:\n%s", logs.String())
				}
				time.Sleep(5 * time.Millisecond) // polling a log: no event to wait on
			}
			waitLog(t, &logs, tc.log)
			moveOne(t, member, rx) // still serving
		})
	}
}

// TestTLSSenderRefuses: a TLS sender does not hand data to a receiver
// whose certificate is not of its CA, nor to a plain TCP receiver; Send
// fails with ErrPeerLost naming the TLS handshake.
func TestTLSSenderRefuses(t *testing.T) {
	other, err := tlsconf.NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	tx := open(t, transport.Options{TLS: party(t, testCA(), "tx")})
	for _, tc := range []struct {
		name string
		rx   transport.Options
		want string
	}{
		{"receiver of another CA", transport.Options{TLS: party(t, other, "rx")}, "certificate signed by unknown authority"},
		{"plain receiver", transport.Options{}, "TLS handshake"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rx := open(t, tc.rx)
			dst := make([]byte, 4096)
			r, err := rx.Expect([][]byte{dst})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Cancel()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err = tx.Send(ctx, r.Descriptor(), [][]byte{make([]byte, 4096)})
			if !errors.Is(err, transport.ErrPeerLost) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Send = %v, want ErrPeerLost with %q", err, tc.want)
			}
		})
	}
}

// TestTLSRefusedSenderLearnsAtOnce: a sender whose certificate the
// receiver refuses learns it from Send, however small the Send (under TLS
// 1.3 the client's handshake ends before the server has checked its
// certificate, so without the receiver's accept a small Send would land in
// the socket buffer and "succeed"); the receipt is untouched and the
// receiver keeps serving its cluster.
func TestTLSRefusedSenderLearnsAtOnce(t *testing.T) {
	ca := testCA()
	other, err := tlsconf.NewAuthority("other CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	rx := open(t, transport.Options{TLS: party(t, ca, "rx")})
	strangerTLS := party(t, ca, "tx") // trusts the receiver's CA ...
	strangerTLS.Client = strangerTLS.Client.Clone()
	strangerCert := party(t, other, "s").Client.Certificates[0]
	strangerTLS.Client.Certificates = nil
	strangerTLS.Client.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
		return &strangerCert, nil // ... but is not of it
	}
	stranger := open(t, transport.Options{TLS: strangerTLS})
	for _, n := range []int{64, 4096} {
		dst := make([]byte, n)
		r, err := rx.Expect([][]byte{dst})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		start := time.Now()
		err = stranger.Send(ctx, r.Descriptor(), [][]byte{bytes.Repeat([]byte{7}, n)})
		cancel()
		if !errors.Is(err, transport.ErrPeerLost) || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("%d-byte Send by a refused sender = %v, want ErrPeerLost saying the receiver refused it", n, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the refusal took %v", d)
		}
		select {
		case <-r.Done():
			t.Fatalf("the receipt ended (%v) from a refused sender", r.Err())
		default:
		}
		if !bytes.Equal(dst, make([]byte, n)) {
			t.Fatal("a refused sender's bytes reached the receipt")
		}
		r.Cancel()
	}
	moveOne(t, open(t, transport.Options{TLS: party(t, ca, "member")}), rx)
}

func TestTLSOptions(t *testing.T) {
	c := party(t, testCA(), "x")
	for _, o := range []*transport.TLSConfig{{Server: c.Server}, {Client: c.Client}} {
		if tr, err := Open(context.Background(), transport.Options{TLS: o}); err == nil {
			tr.Close()
			t.Errorf("Open with TLS %+v succeeded, want an error", o)
		}
	}
}

// recordConn records the writes made to it.
type recordConn struct {
	net.Conn
	writes [][]byte
	err    error
}

func (r *recordConn) Write(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	r.writes = append(r.writes, bytes.Clone(p))
	return len(p), nil
}

// TestBatchConn: outside a frame every write goes through at once (the
// handshake must not wait in a buffer); inside one, writes are gathered up
// to batchBytes and flushed by end, in order; a failed flush is reported.
func TestBatchConn(t *testing.T) {
	rc := &recordConn{}
	b := newBatchConn(rc)
	b.Write([]byte("hello"))
	if len(rc.writes) != 1 {
		t.Fatalf("outside a frame: %d writes, want 1", len(rc.writes))
	}
	b.begin()
	b.Write([]byte("ab"))
	b.Write([]byte("cd"))
	if len(rc.writes) != 1 {
		t.Fatalf("inside a frame: %d writes before end, want 1", len(rc.writes))
	}
	big := bytes.Repeat([]byte{7}, batchBytes-3)
	b.Write(big) // does not fit behind "abcd": flushes it first
	b.Write([]byte("e"))
	huge := bytes.Repeat([]byte{9}, batchBytes)
	b.Write(huge) // larger than the buffer: flush, then straight through
	if err := b.end(); err != nil {
		t.Fatal(err)
	}
	want := [][]byte{[]byte("hello"), []byte("abcd"), append(bytes.Clone(big), 'e'), huge}
	if len(rc.writes) != len(want) {
		t.Fatalf("%d writes, want %d", len(rc.writes), len(want))
	}
	for i := range want {
		if !bytes.Equal(rc.writes[i], want[i]) {
			t.Errorf("write %d: %d bytes, want %d", i, len(rc.writes[i]), len(want[i]))
		}
	}
	rc.err = errors.New("broken")
	b.begin()
	b.Write([]byte("x"))
	if err := b.end(); err == nil {
		t.Error("end after a failed flush: no error")
	}
}
