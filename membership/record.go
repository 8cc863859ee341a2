package membership

import (
	"bytes"
	"encoding/json"

	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Role is the part a worker plays.
type Role string

// Roles.
const (
	RoleContext    Role = "context"
	RoleGeneration Role = "generation"
)

// Valid reports whether r is a known role.
func (r Role) Valid() bool { return r == RoleContext || r == RoleGeneration }

// Limits on a record, checked by Validate and DecodeRecord.
const (
	MaxRecordSize  = 8 << 10 // encoded bytes
	MaxKeySize     = 512
	maxFieldLen    = 256
	maxBackends    = 16
	maxParallelism = 1 << 16
)

// Layout is a worker's parallelism: tensor, pipeline and data parallel
// sizes (each at least 1).
type Layout struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
	DP int `json:"dp"`
}

// Incarnation tells apart the processes that served one address: the
// process's start time in nanoseconds since the epoch. Larger is newer.
type Incarnation uint64

// NewIncarnation returns the incarnation of a process starting now. Call
// it once per process.
func NewIncarnation() Incarnation { return Incarnation(time.Now().UnixNano()) }

// String is the 16 hex digits a member id ends with.
func (i Incarnation) String() string { return fmt.Sprintf("%016x", uint64(i)) }

// Record is what a worker registers: everything the router needs to send
// it requests and to pair it with peers.
type Record struct {
	Role Role `json:"role"`
	// URL is the worker's HTTP endpoint, http(s)://host:port, with an
	// address peers can reach (never 0.0.0.0).
	URL   string `json:"url"`
	Model string `json:"model"`
	// Layout and LayoutFingerprint describe the KV cache's layout; two
	// workers exchange KV blocks only when their layouts are compatible.
	Layout            Layout `json:"layout"`
	LayoutFingerprint string `json:"layout_fingerprint"`
	// Backends are the transceiver backends the worker offers (TCP, UCX,
	// SHM...), in its order of preference.
	Backends     []string    `json:"backends"`
	Incarnation  Incarnation `json:"incarnation"`
	RegisteredAt time.Time   `json:"registered_at"`
}

// Validate checks r's fields and their bounds.
func (r *Record) Validate() error {
	if !r.Role.Valid() {
		return fmt.Errorf("%w: role %q (want %s or %s)", ErrInvalid, clip(string(r.Role)), RoleContext, RoleGeneration)
	}
	if _, _, err := hostPort(r.URL); err != nil {
		return err
	}
	for name, v := range map[string]string{"model": r.Model, "layout_fingerprint": r.LayoutFingerprint} {
		if len(v) > maxFieldLen || !printable(v) {
			return fmt.Errorf("%w: %s: more than %d bytes, or not UTF-8 without control characters", ErrInvalid, name, maxFieldLen)
		}
	}
	for _, n := range []int{r.Layout.TP, r.Layout.PP, r.Layout.DP} {
		if n < 1 || n > maxParallelism {
			return fmt.Errorf("%w: layout %+v: each size in 1..%d", ErrInvalid, r.Layout, maxParallelism)
		}
	}
	if len(r.Backends) > maxBackends {
		return fmt.Errorf("%w: %d backends, at most %d", ErrInvalid, len(r.Backends), maxBackends)
	}
	for _, b := range r.Backends {
		if b == "" || len(b) > 32 || !printable(b) {
			return fmt.Errorf("%w: backend %q", ErrInvalid, clip(b))
		}
	}
	if r.Incarnation == 0 {
		return fmt.Errorf("%w: incarnation 0 (use NewIncarnation)", ErrInvalid)
	}
	return nil
}

// printable reports whether s is UTF-8 without control characters: a
// record's strings end up in logs, /cluster_info and the table of kvxfer
// cluster status, where a newline, a tab or an escape sequence would forge
// or hide rows, or drive the operator's terminal.
func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, c := range s {
		if unicode.IsControl(c) {
			return false
		}
	}
	return true
}

// ID is r's member id: <host>_<port>-<incarnation>, with every byte of the
// host other than [A-Za-z0-9.-] written as '_'.
func (r *Record) ID() (string, error) {
	host, port, err := hostPort(r.URL)
	if err != nil {
		return "", err
	}
	b := make([]byte, 0, len(host)+len(port)+18)
	for i := 0; i < len(host); i++ {
		c := host[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-' {
			b = append(b, c)
		} else {
			b = append(b, '_')
		}
	}
	return string(b) + "_" + port + "-" + r.Incarnation.String(), nil
}

// hostPort checks an http(s)://host:port URL and returns its host and port.
func hostPort(s string) (string, string, error) {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.User != nil || u.Host == "" ||
		(u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" || len(s) > maxFieldLen {
		return "", "", fmt.Errorf("%w: url %q: want http://host:port", ErrInvalid, clip(s))
	}
	host, port, err := net.SplitHostPort(u.Host)
	if n, perr := strconv.Atoi(port); err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("%w: url %q: want http://host:port with a port", ErrInvalid, clip(s))
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return "", "", fmt.Errorf("%w: url %q: %s is no address a peer can reach; advertise the host's address", ErrInvalid, clip(s), host)
	}
	return host, port, nil
}

// EncodeRecord writes r as the value stored under its key.
func EncodeRecord(r *Record) ([]byte, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	if len(b) > MaxRecordSize {
		return nil, fmt.Errorf("%w: record of %d bytes, at most %d", ErrInvalid, len(b), MaxRecordSize)
	}
	return b, nil
}

// DecodeRecord reads a stored value. It refuses values over MaxRecordSize,
// trailing data and records that fail Validate; fields it does not know
// (from newer workers) are ignored.
func DecodeRecord(b []byte) (*Record, error) {
	if len(b) > MaxRecordSize {
		return nil, fmt.Errorf("%w: record of %d bytes, at most %d", ErrInvalid, len(b), MaxRecordSize)
	}
	d := json.NewDecoder(bytes.NewReader(b))
	var r Record
	if err := d.Decode(&r); err != nil {
		return nil, fmt.Errorf("%w: record: %v", ErrInvalid, err)
	}
	if d.More() {
		return nil, fmt.Errorf("%w: record: trailing data", ErrInvalid)
	}
	if err := r.Validate(); err != nil {
		return nil, err
	}
	return &r, nil
}

// Prefix is the key prefix of every worker of cluster:
// /kvxfer/<cluster>/workers/.
func Prefix(cluster string) string { return "/kvxfer/" + cluster + "/workers/" }

// Key is the key of member id of role in cluster.
func Key(cluster string, role Role, id string) string {
	return Prefix(cluster) + string(role) + "/" + id
}

// ParseKey splits a key under Prefix(cluster) into its role, member id and
// the incarnation the id ends with.
func ParseKey(cluster, key string) (Role, string, Incarnation, error) {
	rest, ok := strings.CutPrefix(key, Prefix(cluster))
	if !ok || len(key) > MaxKeySize {
		return "", "", 0, fmt.Errorf("%w: key %q is not under %s", ErrInvalid, clip(key), Prefix(cluster))
	}
	role, id, ok := strings.Cut(rest, "/")
	if !ok || !Role(role).Valid() || strings.Contains(id, "/") {
		return "", "", 0, fmt.Errorf("%w: key %q: want %s<role>/<member-id>", ErrInvalid, clip(key), Prefix(cluster))
	}
	i := strings.LastIndexByte(id, '-')
	if i < 1 || len(id)-i-1 != 16 {
		return "", "", 0, fmt.Errorf("%w: key %q: the member id ends with no incarnation", ErrInvalid, clip(key))
	}
	inc, err := strconv.ParseUint(id[i+1:], 16, 64)
	if err != nil {
		return "", "", 0, fmt.Errorf("%w: key %q: the member id ends with no incarnation", ErrInvalid, clip(key))
	}
	return Role(role), id, Incarnation(inc), nil
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
