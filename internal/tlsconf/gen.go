package tlsconf

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// DefaultValidity is how long the certificates of a test cluster are valid.
const DefaultValidity = 30 * 24 * time.Hour

// LoopbackHosts are in every certificate Issue makes, so that a cluster on
// one machine verifies whatever loopback form its peers dial.
var LoopbackHosts = []string{"127.0.0.1", "::1", "localhost"}

// File names inside a directory written by WriteCluster.
const (
	CAFileName    = "ca.pem"
	CAKeyFileName = "ca-key.pem"
)

// CertFileName and KeyFileName are the files of party name.
func CertFileName(name string) string { return name + ".pem" }

// KeyFileName is the key file of party name.
func KeyFileName(name string) string { return name + "-key.pem" }

// Authority is a CA that signs the certificates of a test cluster.
type Authority struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
}

// NewAuthority makes a self-signed CA with an ECDSA P-256 key, valid from a
// minute ago (clock skew) for validity.
func NewAuthority(name string, validity time.Duration) (*Authority, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("tlsconf: CA key: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"kvxfer test cluster"}},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(validity),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("tlsconf: CA certificate: %w", err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &Authority{Cert: c, Key: key}, nil
}

// CertPEM is the CA certificate in PEM.
func (a *Authority) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: a.Cert.Raw})
}

// KeyPEM is the CA key in PEM (PKCS #8).
func (a *Authority) KeyPEM() ([]byte, error) { return keyPEM(a.Key) }

// Issue makes a certificate for party name, usable both as a server and as
// a client (every member of the cluster listens and dials), valid for the
// loopback addresses and names plus hosts (IP addresses or DNS names), and
// returns it and its new ECDSA P-256 key in PEM. It is valid for at most
// the CA's remaining validity.
func (a *Authority) Issue(name string, hosts []string, validity time.Duration) (certPEM, keyPEMBytes []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconf: key of %s: %w", name, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"kvxfer test cluster"}},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	if tmpl.NotAfter.After(a.Cert.NotAfter) {
		tmpl.NotAfter = a.Cert.NotAfter
	}
	for _, h := range append(slices.Clone(LoopbackHosts), hosts...) {
		h = strings.TrimSpace(h)
		if h == "" {
			continue
		}
		if ip := net.ParseIP(strings.Trim(h, "[]")); ip != nil {
			if !slices.ContainsFunc(tmpl.IPAddresses, ip.Equal) {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			}
		} else if !slices.Contains(tmpl.DNSNames, h) {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.Cert, &key.PublicKey, a.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconf: certificate of %s: %w", name, err)
	}
	kp, err := keyPEM(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), kp, nil
}

// CheckName reports whether name can name a party: its files are
// NAME.pem and NAME-key.pem, so it is a short file-name-safe word.
func CheckName(name string) error {
	switch {
	case name == "":
		return errors.New("tlsconf: empty party name")
	case len(name) > 64:
		return fmt.Errorf("tlsconf: party name %q longer than 64 bytes", name)
	case name == "ca" || name[0] == '.' || name[0] == '-':
		return fmt.Errorf("tlsconf: party name %q is reserved or starts with '.' or '-'", name)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("tlsconf: party name %q: only letters, digits, '-', '_' and '.' are allowed", name)
		}
	}
	return nil
}

// WriteCluster makes a CA and one certificate per name (see Issue) and
// writes them into dir (created 0700 when missing): ca.pem, ca-key.pem,
// NAME.pem and NAME-key.pem. Keys are written 0600, certificates 0644.
// Existing files are not overwritten unless overwrite is set. It returns
// the Files of each name, in order.
func WriteCluster(dir string, names, hosts []string, validity time.Duration, overwrite bool) ([]Files, error) {
	return writeFiles(dir, names, hosts, validity, overwrite, true)
}

// WriteIssued is WriteCluster for a cluster whose parties are all known
// now (kvxfer up's): the CA's key is never written, so no file can mint
// another certificate its parties trust. Existing files are not
// overwritten.
func WriteIssued(dir string, names, hosts []string, validity time.Duration) ([]Files, error) {
	return writeFiles(dir, names, hosts, validity, false, false)
}

func writeFiles(dir string, names, hosts []string, validity time.Duration, overwrite, caKeyFile bool) ([]Files, error) {
	if len(names) == 0 {
		return nil, errors.New("tlsconf: no party names")
	}
	seen := map[string]bool{}
	for _, n := range names {
		if err := CheckName(n); err != nil {
			return nil, err
		}
		if seen[n] {
			return nil, fmt.Errorf("tlsconf: party name %q given twice", n)
		}
		seen[n] = true
	}
	if validity <= 0 {
		validity = DefaultValidity
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("tlsconf: %w", err)
	}
	ca, err := NewAuthority("kvxfer test cluster CA", validity)
	if err != nil {
		return nil, err
	}
	caKey, err := ca.KeyPEM()
	if err != nil {
		return nil, err
	}
	type file struct {
		name string
		data []byte
		mode os.FileMode
	}
	files := []file{{CAFileName, ca.CertPEM(), 0o644}}
	if caKeyFile {
		files = append(files, file{CAKeyFileName, caKey, 0o600})
	}
	out := make([]Files, 0, len(names))
	for _, n := range names {
		c, k, err := ca.Issue(n, hosts, validity)
		if err != nil {
			return nil, err
		}
		files = append(files, file{CertFileName(n), c, 0o644}, file{KeyFileName(n), k, 0o600})
		out = append(out, Files{CertFile: filepath.Join(dir, CertFileName(n)), KeyFile: filepath.Join(dir, KeyFileName(n)),
			CAFile: filepath.Join(dir, CAFileName)})
	}
	if !overwrite {
		for _, f := range files {
			if _, err := os.Lstat(filepath.Join(dir, f.name)); err == nil {
				return nil, fmt.Errorf("tlsconf: %s already exists (remove it or overwrite)", filepath.Join(dir, f.name))
			}
		}
	}
	for _, f := range files {
		if err := writeFile(filepath.Join(dir, f.name), f.data, f.mode); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// writeFile writes data to path with mode, replacing any file there
// atomically (a new file renamed over it), so that a key is never readable
// with a wider mode even for a moment.
func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("tlsconf: %w", err)
	}
	defer os.Remove(tmp.Name()) // after a successful rename there is nothing to remove
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return fmt.Errorf("tlsconf: %w", err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("tlsconf: write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("tlsconf: write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("tlsconf: %w", err)
	}
	return nil
}

func keyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, fmt.Errorf("tlsconf: encode key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// serial returns a random 127-bit certificate serial number.
func serial() *big.Int {
	b := make([]byte, 16)
	rand.Read(b) // never fails (see crypto/rand.Read)
	b[0] &= 0x7f
	return new(big.Int).SetBytes(b)
}

// Party issues a certificate for name (see Issue) and returns its mutual-TLS
// configs in memory, without files: for tests and for processes that make
// their own cluster.
func (a *Authority) Party(name string, hosts []string, validity time.Duration) (*Config, error) {
	c, k, err := a.Issue(name, hosts, validity)
	if err != nil {
		return nil, err
	}
	cert, err := tls.X509KeyPair(c, k)
	if err != nil {
		return nil, fmt.Errorf("tlsconf: certificate of %s: %w", name, err)
	}
	return New(cert, a.Pool()), nil
}

// Pool is a certificate pool holding only the CA.
func (a *Authority) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(a.Cert)
	return p
}
