// Package tlsconf builds the mutual-TLS settings of a kvxfer cluster from
// PEM files, and writes the files of a test cluster.
//
// It owns two things: Load, which turns a party's certificate, key and
// cluster CA into the server and client *tls.Config of mutual TLS (TLS 1.3
// only, client certificates required and verified against the CA, the
// server's certificate verified against the CA and the name or address
// dialled), with errors that name the file and what is wrong with it; and
// NewAuthority / WriteCluster, which make a self-signed CA and per-party
// certificates (ECDSA P-256, short validity) for `kvxfer certs` and
// `kvxfer up --tls`. Config.Transport hands a party's configs to the
// transfer planes in package transport's form.
//
// Trust is the CA: any certificate it signed is a member of the cluster.
// Names inside certificates are used only to check that a client reached
// the server it dialled; a server does not check which member a client is.
// It does not own where the files come from (flags, the config's
// security.tls block) nor what is wrapped with the configs (the tcp data
// plane, the transceiver's control plane, router <-> worker HTTP).
package tlsconf
