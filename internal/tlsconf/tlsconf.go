package tlsconf

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/kvxfer/kvxfer/transport"
)

// ErrIncomplete is returned by Files.Load when some of the three files are
// named and others are not.
var ErrIncomplete = errors.New("tlsconf: mutual TLS needs a certificate, its key and the CA; some are missing")

// Files names the PEM files of one party of the cluster: its certificate
// (the leaf first, intermediates after it), the certificate's private key,
// and the CA that signs every member of the cluster.
type Files struct {
	CertFile string `json:"cert_file"`
	KeyFile  string `json:"key_file"`
	CAFile   string `json:"ca_file"`
}

// Enabled reports whether any file is named: TLS is wanted.
func (f Files) Enabled() bool { return f.CertFile != "" || f.KeyFile != "" || f.CAFile != "" }

// Config is one party's mutual TLS: Server for its listeners, Client for
// its dials. Both present the party's certificate and trust only the CA.
type Config struct {
	// Server requires and verifies a client certificate signed by the CA.
	Server *tls.Config
	// Client verifies the server's certificate against the CA and the host
	// dialled (crypto/tls takes ServerName from the address when it is
	// empty, as it is here) and presents the party's certificate.
	Client *tls.Config
	// Leaf is the party's certificate, parsed.
	Leaf *x509.Certificate
}

// Transport returns c as the transfer planes take it (the transceiver's
// control connections and the tcp data plane); nil when c is nil.
func (c *Config) Transport() *transport.TLSConfig {
	if c == nil {
		return nil
	}
	return &transport.TLSConfig{Server: c.Server, Client: c.Client}
}

// Load reads the files and returns the party's mutual-TLS configs. It
// returns (nil, nil) when no file is named, ErrIncomplete (wrapped, naming
// what is missing) when only some are, and an error naming the file and
// the problem when a file cannot be read, holds no PEM block of the right
// kind, the key does not match the certificate, the certificate is outside
// its validity period, or the certificate is not signed by the CA.
func Load(f Files) (*Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	var missing []string
	for _, m := range []struct{ name, v string }{{"certificate", f.CertFile}, {"key", f.KeyFile}, {"CA", f.CAFile}} {
		if m.v == "" {
			missing = append(missing, m.name)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: no %v file given", ErrIncomplete, missing)
	}
	pool, err := loadCA(f.CAFile)
	if err != nil {
		return nil, err
	}
	cert, leaf, err := loadPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	inter := x509.NewCertPool()
	for _, der := range cert.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("tlsconf: certificate %s is not signed by the CA in %s: %w", f.CertFile, f.CAFile, err)
	}
	return New(cert, pool), nil
}

// loadPair reads a certificate chain and its key, and checks that they
// match and that the certificate is within its validity period.
func loadPair(certFile, keyFile string) (tls.Certificate, *x509.Certificate, error) {
	certPEM, err := readPEM(certFile, "certificate", "CERTIFICATE")
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	keyPEM, err := readPEM(keyFile, "key", "PRIVATE KEY", "EC PRIVATE KEY", "RSA PRIVATE KEY")
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("tlsconf: certificate %s with key %s: %w", certFile, keyFile, err)
	}
	leaf := cert.Leaf
	if leaf == nil { // X509KeyPair fills Leaf since Go 1.23; be safe
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return tls.Certificate{}, nil, fmt.Errorf("tlsconf: certificate %s: %w", certFile, err)
		}
	}
	now := time.Now()
	switch {
	case now.Before(leaf.NotBefore):
		return tls.Certificate{}, nil, fmt.Errorf("tlsconf: certificate %s is not valid before %s", certFile, leaf.NotBefore.UTC().Format(time.RFC3339))
	case now.After(leaf.NotAfter):
		return tls.Certificate{}, nil, fmt.Errorf("tlsconf: certificate %s expired at %s", certFile, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	return cert, leaf, nil
}

// LoadClient returns the TLS config of a client of a server outside the
// cluster (etcd): it verifies the server's certificate against the CAs in
// caFile (the system's roots when caFile is "") and the name or address
// dialled, and presents certFile/keyFile when they are given (both or
// neither). It accepts TLS 1.2, which such servers may be limited to.
// Errors name the file and what is wrong with it.
func LoadClient(caFile, certFile, keyFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pool, err := loadCA(caFile)
		if err != nil {
			return nil, err
		}
		c.RootCAs = pool
	}
	switch {
	case certFile != "" && keyFile != "":
		cert, _, err := loadPair(certFile, keyFile)
		if err != nil {
			return nil, err
		}
		c.Certificates = []tls.Certificate{cert}
	case certFile != "" || keyFile != "":
		return nil, fmt.Errorf("%w: a client certificate needs both its certificate and its key file", ErrIncomplete)
	}
	return c, nil
}

// New returns the mutual-TLS configs of a party with certificate cert in a
// cluster whose CA pool is ca.
func New(cert tls.Certificate, ca *x509.CertPool) *Config {
	leaf := cert.Leaf
	if leaf == nil && len(cert.Certificate) > 0 {
		leaf, _ = x509.ParseCertificate(cert.Certificate[0])
	}
	return &Config{
		Server: &tls.Config{
			MinVersion:   tls.VersionTLS13,
			Certificates: []tls.Certificate{cert},
			ClientAuth:   tls.RequireAndVerifyClientCert,
			ClientCAs:    ca,
		},
		Client: &tls.Config{
			MinVersion:   tls.VersionTLS13,
			Certificates: []tls.Certificate{cert},
			RootCAs:      ca,
		},
		Leaf: leaf,
	}
}

// loadCA reads a PEM file of CA certificates.
func loadCA(path string) (*x509.CertPool, error) {
	b, err := readPEM(path, "CA", "CERTIFICATE")
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	for i := 1; len(b) > 0; i++ {
		var blk *pem.Block
		blk, b = pem.Decode(b)
		if blk == nil {
			break
		}
		if blk.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("tlsconf: CA file %s: certificate %d: %w", path, i, err)
		}
		if !c.IsCA {
			return nil, fmt.Errorf("tlsconf: CA file %s: certificate %d (%s) is not a CA certificate (basic constraints CA:false)", path, i, c.Subject)
		}
		pool.AddCert(c)
	}
	return pool, nil
}

// readPEM reads path and checks that it holds at least one PEM block of
// one of the types; what names the file's role in errors.
func readPEM(path, what string, types ...string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tlsconf: %s file: %w", what, err)
	}
	rest := b
	var seen []string
	for {
		var blk *pem.Block
		blk, rest = pem.Decode(rest)
		if blk == nil {
			break
		}
		for _, t := range types {
			if blk.Type == t {
				return b, nil
			}
		}
		seen = append(seen, blk.Type)
	}
	if len(seen) == 0 {
		return nil, fmt.Errorf("tlsconf: %s file %s: no PEM block (want %s)", what, path, types[0])
	}
	return nil, fmt.Errorf("tlsconf: %s file %s: PEM blocks %q, none of them %s", what, path, seen, types[0])
}
