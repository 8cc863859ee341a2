package capi

import (
	"fmt"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/kvxfer/kvxfer/transceiver"
	"github.com/kvxfer/kvxfer/transport"
)

// Config is a loaded, validated worker config: what a rank of the C ABI
// is built from. It is immutable and may be shared by several ranks.
type Config struct {
	// File is the loaded file (its warnings included).
	File *config.File
	ct   *config.CacheTransceiver
	// secret, allowed and tls are the security block's, read at load.
	secret  []byte
	allowed []string
	tls     *transport.TLSConfig
}

// LoadConfig loads a worker config as `kvxfer config check` does (same
// rules, same messages): from the file at path when data is nil, else from
// data, named name in messages. It also reads the cluster secret and the
// TLS files the security block names, and checks that this library can run
// the configured backend, so that a config that loads here does not fail
// later in Open for a reason of the config.
func LoadConfig(name string, data []byte, env config.Env) (*Config, error) {
	var f *config.File
	var err error
	if data == nil {
		f, err = config.LoadFile(name, env)
	} else {
		f, err = config.LoadBytes(name, data, env)
	}
	if err != nil {
		return nil, &Error{Code: CodeConfig, Err: err}
	}
	if f.Kind != config.KindWorker {
		return nil, errorf(CodeConfig, "%s: is a cluster file (context_servers/generation_servers); a rank needs a worker file with cache_transceiver_config", name)
	}
	ct := f.Worker.CacheTransceiver
	if ct == nil || ct.Backend == config.BackendUnset {
		return nil, errorf(CodeConfig, "%s: has no cache_transceiver_config.backend: %w", name, config.ErrNoTransceiver)
	}
	if r := ct.Resolve(transceiver.Availability); r.Err != nil {
		return nil, errorf(CodeConfig, "%s: cache_transceiver_config.backend: %s → %s: %s: in this library: %v", name, r.Configured, r.Backend, r.Reason, r.Err)
	}
	c := &Config{File: f, ct: ct, allowed: f.Worker.Security.AllowedPeerHosts}
	sec := f.Worker.Security
	if c.secret, _, err = sec.LoadSecret(env); err != nil {
		return nil, &Error{Code: CodeConfig, Err: fmt.Errorf("%s: %w", name, err)}
	}
	if sec.TLS.Enabled() {
		tc, err := tlsconf.Load(tlsconf.Files{CertFile: sec.TLS.CertFile, KeyFile: sec.TLS.KeyFile, CAFile: sec.TLS.CAFile})
		if err != nil {
			return nil, &Error{Code: CodeConfig, Err: fmt.Errorf("%s: security.tls: %w", name, err)}
		}
		c.tls = tc.Transport()
	}
	return c, nil
}

// Warnings returns the loader's warnings, one per line, as config check
// prints them.
func (c *Config) Warnings() []string {
	out := make([]string, len(c.File.Warnings))
	for i, w := range c.File.Warnings {
		out[i] = w.String()
	}
	return out
}

// Backend returns the configured backend and what it resolves to in this
// library ("TCP → TCP").
func (c *Config) Backend() string {
	r := c.ct.Resolve(transceiver.Availability)
	return fmt.Sprintf("%s → %s", r.Configured, r.Backend)
}
