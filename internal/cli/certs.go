package cli

import (
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/config"
	"github.com/kvxfer/kvxfer/internal/tlsconf"
	"github.com/spf13/cobra"
)

// tlsFlags are the mutual-TLS files of serve, router and up.
type tlsFlags struct{ files tlsconf.Files }

func (t *tlsFlags) add(cmd *cobra.Command, what string) {
	f := cmd.Flags()
	f.StringVar(&t.files.CertFile, "tls-cert", "", "PEM certificate of this process for mutual TLS "+what+" (with --tls-key and --tls-ca)")
	f.StringVar(&t.files.KeyFile, "tls-key", "", "PEM private key of --tls-cert")
	f.StringVar(&t.files.CAFile, "tls-ca", "", "PEM certificate of the cluster CA: peers must present a certificate it signed")
}

// or returns the flags' files when any flag is set, else the files of a
// config file's security.tls block.
func (t *tlsFlags) or(c config.TLSFiles) tlsconf.Files {
	if t.files != (tlsconf.Files{}) {
		return t.files
	}
	return tlsconf.Files{CertFile: c.CertFile, KeyFile: c.KeyFile, CAFile: c.CAFile}
}

// loadOr is load with the files of or: the flags win over the config file.
func (t *tlsFlags) loadOr(c config.TLSFiles) (*tlsconf.Config, error) {
	f := t.or(c)
	cfg, err := tlsconf.Load(f)
	if err != nil {
		if f == t.files {
			return nil, fmt.Errorf("--tls-cert/--tls-key/--tls-ca: %w", err)
		}
		return nil, fmt.Errorf("security.tls: %w", err)
	}
	return cfg, nil
}

func newCertsCmd() *cobra.Command {
	var (
		out          string
		hosts, names []string
		validity     time.Duration
		force        bool
	)
	cmd := &cobra.Command{
		Use:   "certs",
		Short: "Write a self-signed CA and per-process certificates for a test cluster's mutual TLS",
		Long: `certs makes a CA (ECDSA P-256) and, signed by it, one certificate and key per name,
and writes them into --out (created 0700): ca.pem, ca-key.pem, NAME.pem and NAME-key.pem
(keys 0600). Every certificate is valid as a server and as a client, for 127.0.0.1, ::1,
localhost and the --hosts (IP addresses or DNS names the processes are dialled at), for
--validity. They are for test clusters; a production cluster uses its own PKI.

Pass a process its files with --tls-cert NAME.pem --tls-key NAME-key.pem --tls-ca ca.pem
(kvxfer serve, router, up). Keep ca-key.pem away from the processes: they need only ca.pem.`,
		Example: `  kvxfer certs --out ./certs --hosts 10.0.0.5,node1 --names ctx0,gen0,router
  kvxfer serve --role context --tls-cert certs/ctx0.pem --tls-key certs/ctx0-key.pem --tls-ca certs/ca.pem`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return fmt.Errorf("--out: a directory to write the certificates into is required")
			}
			fs, err := tlsconf.WriteCluster(out, names, hosts, validity, force)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "CA:  %s (key %s)\n", filepath.Join(out, tlsconf.CAFileName), filepath.Join(out, tlsconf.CAKeyFileName))
			for i, f := range fs {
				fmt.Fprintf(w, "%-12s --tls-cert %s --tls-key %s --tls-ca %s\n", names[i]+":", f.CertFile, f.KeyFile, f.CAFile)
			}
			fmt.Fprintf(w, "valid for %s, hosts 127.0.0.1 ::1 localhost %s\n", validity, strings.Join(hosts, " "))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&out, "out", "", "directory to write into (created 0700 if missing)")
	f.StringSliceVar(&hosts, "hosts", nil, "extra IP addresses or DNS names every certificate is valid for, comma-separated")
	f.StringSliceVar(&names, "names", []string{"ctx0", "gen0", "router"}, "one certificate per name, comma-separated")
	f.DurationVar(&validity, "validity", tlsconf.DefaultValidity, "how long the CA and the certificates are valid")
	f.BoolVar(&force, "force", false, "overwrite existing files")
	return cmd
}
