package config

import (
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Environment variables of the security block.
const (
	// EnvClusterSecret is read for the cluster secret when the security
	// block names neither secret_file nor secret_env. `kvxfer up` sets it
	// for the workers it starts.
	EnvClusterSecret = "KVXFER_CLUSTER_SECRET"
	// EnvAllowedPeerHosts is TensorRT-LLM's list of hosts a worker may
	// dial for KV-cache transfer (comma-separated). kvxfer merges it with
	// security.allowed_peer_hosts.
	EnvAllowedPeerHosts = "TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS"
)

// Limits of the cluster secret.
const (
	// MinSecretBytes is the shortest cluster secret accepted, after
	// trimming white space and hex decoding.
	MinSecretBytes = 32
	// maxSecretFile bounds what LoadSecret reads from a secret file.
	maxSecretFile = 64 << 10
	// maxPeerHosts bounds the allow-list.
	maxPeerHosts = MaxParallel
)

// Security is kvxfer's own `security:` block (TensorRT-LLM has none), at
// the top level of a worker file or of a cluster file (where it applies to
// the router and to every worker), together with the environment variables
// of the same settings.
//
// The secret itself is never part of a loaded config: the block says where
// it is, and LoadSecret reads it when a program needs it.
type Security struct {
	// SecretFile is a file holding the cluster secret.
	SecretFile string
	// SecretEnv names an environment variable holding the cluster secret.
	// With neither SecretFile nor SecretEnv, EnvClusterSecret is read.
	SecretEnv string
	// AllowedPeerHosts are the hosts this worker may dial for KV-cache
	// transfer and accept transfer connections from: host names, IP
	// addresses or CIDR prefixes (10.0.0.0/8), no ports. Loopback is
	// always allowed. It holds the file's entries, then those of
	// TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS not already listed.
	AllowedPeerHosts []string
	// TLS names the certificate files for TLS. It is only parsed and
	// checked for shape here (cert_file and key_file both or neither);
	// whether the files exist and hold what they should is checked where
	// they are used.
	TLS TLSFiles
	// Etcd are the settings of this process's etcd client, for a
	// disagg_cluster whose cluster_uri is etcd://: TLS (server
	// verification and, optionally, a client certificate) and etcd's own
	// authentication. Like TLS, only parsed and checked for shape here.
	Etcd EtcdClient
}

// EtcdClient is the security.etcd block: how this process connects to an
// etcd cluster. With any of CAFile, CertFile or KeyFile set the client
// speaks TLS; with Username it authenticates as that etcd user.
type EtcdClient struct {
	// CAFile is a PEM bundle of the CAs etcd's server certificate must
	// chain to; empty: the system's roots.
	CAFile string
	// CertFile and KeyFile are a client certificate and its key, both or
	// neither, for an etcd that requires client certificates
	// (--client-cert-auth).
	CertFile, KeyFile string
	// Username is the etcd user (etcd's auth enabled); PasswordFile holds
	// its password (trailing white space trimmed). Both or neither.
	Username     string
	PasswordFile string
}

// LoadPassword reads the password of Username from PasswordFile (trailing
// white space trimmed); "" when no file is named. A named pipe is read
// within PipeTimeout, as LoadFile reads one.
func (e EtcdClient) LoadPassword() (string, error) { return e.loadPassword(PipeTimeout) }

// loadPassword is LoadPassword with pipeWait in place of PipeTimeout.
func (e EtcdClient) loadPassword(pipeWait time.Duration) (string, error) {
	if e.PasswordFile == "" {
		return "", nil
	}
	b, err := readUpTo(e.PasswordFile, maxSecretFile+1, pipeWait)
	switch {
	case err != nil:
		return "", fmt.Errorf("config: security.etcd.password_file %s: %s", e.PasswordFile, describeOSError(err))
	case len(b) > maxSecretFile:
		return "", fmt.Errorf("config: security.etcd.password_file %s is larger than %d bytes; not a password file", e.PasswordFile, maxSecretFile)
	}
	pw := strings.TrimRight(string(b), " \t\r\n")
	if pw == "" {
		return "", fmt.Errorf("config: security.etcd.password_file %s is empty", e.PasswordFile)
	}
	return pw, nil
}

// TLS reports whether the block asks for TLS.
func (e EtcdClient) TLS() bool { return e.CAFile != "" || e.CertFile != "" || e.KeyFile != "" }

// TLSFiles are the file paths of the security.tls block. Relative paths are
// relative to the working directory of the process that uses them.
type TLSFiles struct {
	CertFile string // PEM certificate chain of this process
	KeyFile  string // PEM private key of CertFile
	CAFile   string // PEM CA bundle that peers' certificates must chain to
}

// Enabled reports whether a certificate is configured.
func (t TLSFiles) Enabled() bool { return t.CertFile != "" }

// ErrNoSecret is returned by LoadSecret when the block names a secret that
// is not there (a secret_env variable that is unset).
var ErrNoSecret = errors.New("config: cluster secret not found")

// LoadSecret reads the cluster secret: from SecretFile when set, else from
// the variable SecretEnv names, else from KVXFER_CLUSTER_SECRET. It returns
// the secret, where it came from ("file PATH" or "env NAME"; never the
// secret itself), or (nil, "", nil) when nothing is configured and
// KVXFER_CLUSTER_SECRET is unset.
//
// The content is trimmed of white space; when what is left is an even
// number of hex digits it is hex-decoded, else used as it is. The result
// must be at least MinSecretBytes long. A named pipe is read within
// PipeTimeout, as LoadFile reads one.
func (s *Security) LoadSecret(env Env) ([]byte, string, error) { return s.loadSecret(env, PipeTimeout) }

// loadSecret is LoadSecret with pipeWait in place of PipeTimeout.
func (s *Security) loadSecret(env Env, pipeWait time.Duration) ([]byte, string, error) {
	var raw, source string
	switch {
	case s.SecretFile != "":
		source = "file " + s.SecretFile
		b, err := readUpTo(s.SecretFile, maxSecretFile+1, pipeWait)
		if err != nil {
			return nil, source, fmt.Errorf("config: security.secret_file %s: %s", s.SecretFile, describeOSError(err))
		}
		if len(b) > maxSecretFile {
			return nil, source, fmt.Errorf("config: security.secret_file %s is larger than %d bytes; not a secret file", s.SecretFile, maxSecretFile)
		}
		raw = string(b)
	case s.SecretEnv != "":
		source = "env " + s.SecretEnv
		v, ok := env.lookupVar(s.SecretEnv)
		if !ok {
			return nil, source, fmt.Errorf("%w: security.secret_env names %s, which is not set", ErrNoSecret, s.SecretEnv)
		}
		raw = v
	default:
		v, ok := env.lookupVar(EnvClusterSecret)
		if !ok {
			return nil, "", nil
		}
		source, raw = "env "+EnvClusterSecret, v
	}
	secret, err := parseSecret(raw)
	if err != nil {
		return nil, source, fmt.Errorf("config: cluster secret from %s: %w", source, err)
	}
	return secret, source, nil
}

func parseSecret(raw string) ([]byte, error) {
	t := strings.TrimSpace(raw)
	if t == "" {
		return nil, errors.New("empty")
	}
	form := "raw"
	b := []byte(t)
	if len(t)%2 == 0 {
		if d, err := hex.DecodeString(t); err == nil {
			b, form = d, "hex-decoded"
		}
	}
	if len(b) < MinSecretBytes {
		return nil, fmt.Errorf("%d bytes (%s), at least %d are needed (for example: openssl rand -hex %d)", len(b), form, MinSecretBytes, MinSecretBytes)
	}
	return b, nil
}

// SecurityFromEnv returns the security settings of a worker started
// without a config file: the allow-list of TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS,
// the secret from KVXFER_CLUSTER_SECRET (see LoadSecret).
func SecurityFromEnv(env Env) (Security, error) {
	var s Security
	c := &collector{}
	applySecurityEnv(&s, env, c, map[string]Source{}, "security")
	if errs := c.errs(); len(errs) > 0 {
		return s, errs
	}
	return s, nil
}

// ParsePeerHost checks one allow-list entry and returns its canonical form:
// an IP address (brackets of an IPv6 literal removed), a CIDR prefix
// (masked), or a host name in lower case. Ports are refused.
func ParsePeerHost(s string) (string, error) {
	h := strings.TrimSpace(s)
	if h == "" {
		return "", errors.New("empty host")
	}
	if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		h = h[1 : len(h)-1]
	}
	if a, err := netip.ParseAddr(h); err == nil {
		if a.Zone() != "" {
			return "", fmt.Errorf("%q: IPv6 zones are not supported in the allow-list", s)
		}
		return a.Unmap().String(), nil
	}
	if strings.Contains(h, "/") {
		p, err := netip.ParsePrefix(h)
		if err != nil {
			return "", fmt.Errorf("%q is not a valid CIDR prefix (want address/bits, e.g. 10.0.0.0/8)", s)
		}
		return p.Masked().String(), nil
	}
	if strings.Contains(h, ":") {
		return "", fmt.Errorf("%q: want a host without a port (an IP address, a CIDR prefix or a host name)", s)
	}
	if len(h) > 253 || !hostNameRE.MatchString(h) {
		return "", fmt.Errorf("%q is not a host name, an IP address or a CIDR prefix", s)
	}
	return strings.ToLower(h), nil
}

var (
	hostNameRE = regexp.MustCompile(`^([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$`)
	envNameRE  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// security loads a security block (n may be nil: no block) and applies the
// environment.
func (l *loader) security(n *yaml.Node, path string, env Env) Security {
	var s Security
	if n != nil && l.mapping(n, path) {
		var fileKey, envKey *yaml.Node
		l.fields(n, path, map[string]func(k, v *yaml.Node){
			"secret_file": func(k, v *yaml.Node) {
				p := join(path, "secret_file")
				if l.str(v, p, &s.SecretFile) && strings.TrimSpace(s.SecretFile) == "" {
					l.errAt(v, p, "must not be empty (leave the key out to read %s)", EnvClusterSecret)
				}
				fileKey = k
			},
			"secret_env": func(k, v *yaml.Node) {
				p := join(path, "secret_env")
				if l.str(v, p, &s.SecretEnv) && !envNameRE.MatchString(s.SecretEnv) {
					l.errAt(v, p, "%q is not an environment variable name", truncate(s.SecretEnv))
				}
				envKey = k
			},
			"allowed_peer_hosts": func(k, v *yaml.Node) { l.peerHosts(v, join(path, "allowed_peer_hosts"), &s) },
			"tls":                func(k, v *yaml.Node) { l.tls(v, join(path, "tls"), &s.TLS) },
			"etcd":               func(k, v *yaml.Node) { l.etcdClient(v, join(path, "etcd"), &s.Etcd) },
		}, nil, true)
		if fileKey != nil && envKey != nil {
			later := fileKey
			if envKey.Line > fileKey.Line || (envKey.Line == fileKey.Line && envKey.Column > fileKey.Column) {
				later = envKey
			}
			l.errAt(later, join(path, later.Value), "set secret_file or secret_env, not both")
		}
	}
	applySecurityEnv(&s, env, l.c, l.src, path)
	return s
}

func (l *loader) peerHosts(n *yaml.Node, path string, s *Security) {
	entries, ok := l.list(n, path, "hosts", maxPeerHosts)
	if !ok {
		return
	}
	l.mark(n, path)
	for i, e := range entries {
		e = deref(e)
		ep := fmt.Sprintf("%s[%d]", path, i)
		if e.Kind != yaml.ScalarNode || e.Tag != "!!str" {
			l.errAt(e, ep, "want a host (a string), got %s", describeNode(e))
			continue
		}
		c, err := ParsePeerHost(e.Value)
		if err != nil {
			l.errAt(e, ep, "%v", err)
			continue
		}
		if slices.Contains(s.AllowedPeerHosts, c) {
			l.c.add(SevWarning, e.Line, e.Column, ep, "%s is listed twice", c)
			continue
		}
		// Sources are kept by position in the effective list.
		l.mark(e, fmt.Sprintf("%s[%d]", path, len(s.AllowedPeerHosts)))
		s.AllowedPeerHosts = append(s.AllowedPeerHosts, c)
	}
}

// nonEmpty reads key name of the block at path into dst: a string that
// must not be blank.
func (l *loader) nonEmpty(path, name string, dst *string) func(k, v *yaml.Node) {
	return func(k, v *yaml.Node) {
		p := join(path, name)
		if l.str(v, p, dst) && strings.TrimSpace(*dst) == "" {
			l.errAt(v, p, "must not be empty (leave the key out instead)")
		}
	}
}

func (l *loader) tls(n *yaml.Node, path string, t *TLSFiles) {
	file := func(name string, dst *string) func(k, v *yaml.Node) { return l.nonEmpty(path, name, dst) }
	if !l.block(n, path, map[string]func(k, v *yaml.Node){
		"cert_file": file("cert_file", &t.CertFile),
		"key_file":  file("key_file", &t.KeyFile),
		"ca_file":   file("ca_file", &t.CAFile),
	}, nil, true) {
		return
	}
	switch {
	case t.CertFile != "" && t.KeyFile == "":
		l.errAt(n, join(path, "key_file"), "missing: cert_file is set, and a certificate needs its private key")
	case t.KeyFile != "" && t.CertFile == "":
		l.errAt(n, join(path, "cert_file"), "missing: key_file is set, and a private key needs its certificate")
	}
}

func (l *loader) etcdClient(n *yaml.Node, path string, e *EtcdClient) {
	str := func(name string, dst *string) func(k, v *yaml.Node) { return l.nonEmpty(path, name, dst) }
	if !l.block(n, path, map[string]func(k, v *yaml.Node){
		"ca_file":       str("ca_file", &e.CAFile),
		"cert_file":     str("cert_file", &e.CertFile),
		"key_file":      str("key_file", &e.KeyFile),
		"username":      str("username", &e.Username),
		"password_file": str("password_file", &e.PasswordFile),
	}, nil, true) {
		return
	}
	pairs := []struct{ a, b, va, vb, why string }{
		{"cert_file", "key_file", e.CertFile, e.KeyFile, "a client certificate needs its private key"},
		{"key_file", "cert_file", e.KeyFile, e.CertFile, "a private key needs its certificate"},
		{"username", "password_file", e.Username, e.PasswordFile, "etcd authenticates a user by its password"},
		{"password_file", "username", e.PasswordFile, e.Username, "a password is of a user"},
	}
	for _, p := range pairs {
		if p.va != "" && p.vb == "" {
			l.errAt(n, join(path, p.b), "missing: %s is set, and %s", p.a, p.why)
		}
	}
}

// applySecurityEnv appends the hosts of TRTLLM_KV_TRANSFER_ALLOWED_PEER_HOSTS
// that s does not list yet, recording each one's source.
func applySecurityEnv(s *Security, env Env, c *collector, src map[string]Source, path string) {
	v, ok := env.Raw[EnvAllowedPeerHosts]
	if !ok {
		return
	}
	for _, h := range strings.Split(v, ",") {
		if strings.TrimSpace(h) == "" {
			continue
		}
		ch, err := ParsePeerHost(h)
		if err != nil {
			c.envErr(EnvAllowedPeerHosts, "%v", err)
			continue
		}
		if slices.Contains(s.AllowedPeerHosts, ch) {
			continue
		}
		if len(s.AllowedPeerHosts) >= maxPeerHosts {
			c.envErr(EnvAllowedPeerHosts, "more than %d allowed peer hosts", maxPeerHosts)
			return
		}
		src[fmt.Sprintf("%s.allowed_peer_hosts[%d]", path, len(s.AllowedPeerHosts))] = Source{Kind: SourceEnv, Env: EnvAllowedPeerHosts}
		s.AllowedPeerHosts = append(s.AllowedPeerHosts, ch)
	}
}

// addSecurity writes the security block of f with its sources. Hosts that
// come from the environment are comments, so that the output loads back
// (with the same environment) to the same list. The secret is never
// written; only where it is to be found.
func (f *File) addSecurity(m *yaml.Node, path string, s *Security) {
	sm := &yaml.Node{Kind: yaml.MappingNode}
	m.Content = append(m.Content, key(lastElem(path)), sm)
	var fromFile, fromEnv []string
	for i, h := range s.AllowedPeerHosts {
		if f.Source(fmt.Sprintf("%s.allowed_peer_hosts[%d]", path, i)).Kind == SourceEnv {
			fromEnv = append(fromEnv, h)
		} else {
			fromFile = append(fromFile, h)
		}
	}
	if s.SecretFile != "" {
		f.addScalar(sm, path, "secret_file", "!!str", s.SecretFile)
	}
	if s.SecretEnv != "" {
		f.addScalar(sm, path, "secret_env", "!!str", s.SecretEnv)
	}
	if len(fromFile) > 0 {
		seq := &yaml.Node{Kind: yaml.SequenceNode, Style: yaml.FlowStyle, LineComment: f.Source(join(path, "allowed_peer_hosts")).String()}
		for _, h := range fromFile {
			seq.Content = append(seq.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: h})
		}
		sm.Content = append(sm.Content, key("allowed_peer_hosts"), seq)
	}
	if s.TLS != (TLSFiles{}) {
		tm := &yaml.Node{Kind: yaml.MappingNode}
		sm.Content = append(sm.Content, key("tls"), tm)
		tp := join(path, "tls")
		for _, kv := range []struct{ k, v string }{{"cert_file", s.TLS.CertFile}, {"key_file", s.TLS.KeyFile}, {"ca_file", s.TLS.CAFile}} {
			if kv.v != "" {
				f.addScalar(tm, tp, kv.k, "!!str", kv.v)
			}
		}
	}
	if e := s.Etcd; e != (EtcdClient{}) {
		em := &yaml.Node{Kind: yaml.MappingNode}
		sm.Content = append(sm.Content, key("etcd"), em)
		ep := join(path, "etcd")
		for _, kv := range []struct{ k, v string }{{"ca_file", e.CAFile}, {"cert_file", e.CertFile}, {"key_file", e.KeyFile},
			{"username", e.Username}, {"password_file", e.PasswordFile}} {
			if kv.v != "" {
				f.addScalar(em, ep, kv.k, "!!str", kv.v)
			}
		}
	}
	var notes []string
	if s.SecretFile == "" && s.SecretEnv == "" {
		notes = append(notes, "secret: env "+EnvClusterSecret+" if set, else none (unauthenticated)")
	}
	if len(fromEnv) > 0 {
		notes = append(notes, fmt.Sprintf("allowed peer hosts from env %s: %s", EnvAllowedPeerHosts, strings.Join(fromEnv, ", ")))
	}
	if len(s.AllowedPeerHosts) == 0 {
		notes = append(notes, "allowed peer hosts: none (loopback only without a secret, any with one)")
	}
	if len(sm.Content) == 0 {
		sm.Style = yaml.FlowStyle
		sm.LineComment = strings.Join(notes, "; ")
		return
	}
	sm.Content[0].HeadComment = strings.Join(notes, "\n")
}
