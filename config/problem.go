package config

import (
	"errors"
	"fmt"
	"strings"
)

// Severity says whether a Problem makes a config invalid.
type Severity uint8

// Severities.
const (
	// SevError makes the config invalid.
	SevError Severity = iota
	// SevWarning is shown but does not fail the config (an ignored key,
	// an environment variable with no effect).
	SevWarning
)

func (s Severity) String() string {
	if s == SevWarning {
		return "warning"
	}
	return "error"
}

// Kinds of warning, so that a caller can group them (config check lists the
// settings that are accepted but not applied on their own).
const (
	// KindNotUsed marks a TensorRT-LLM key that kvxfer does not read.
	KindNotUsed = "not-used"
	// KindNotApplied marks a setting kvxfer reads and checks but that has
	// no effect (yet, or ever: see the message).
	KindNotApplied = "not-applied"
	// KindDeprecated marks an older TensorRT-LLM form, loaded with the
	// meaning it had; the message names the current form.
	KindDeprecated = "deprecated"
)

// Problem is one finding about a config: where it is (file, line, column,
// field path, or environment variable) and what is wrong.
type Problem struct {
	Severity Severity
	File     string // file name as given by the caller; "" for the environment
	Line     int    // 1-based; 0 when unknown
	Col      int    // 1-based; 0 when unknown
	Path     string // dotted field path, e.g. "cache_transceiver_config.backend"
	Msg      string
	// Kind groups warnings (KindNotUsed, KindNotApplied, KindDeprecated);
	// "" for the others and for errors.
	Kind string
}

// String formats p on one line: "file:line:col: path: message".
func (p Problem) String() string {
	var b strings.Builder
	if p.File != "" {
		b.WriteString(p.File)
		if p.Line > 0 {
			fmt.Fprintf(&b, ":%d", p.Line)
			if p.Col > 0 {
				fmt.Fprintf(&b, ":%d", p.Col)
			}
		}
		b.WriteString(": ")
	}
	if p.Path != "" {
		b.WriteString(p.Path)
		b.WriteString(": ")
	}
	b.WriteString(p.Msg)
	return b.String()
}

// ErrInvalid is matched by errors.Is on every Problems error.
var ErrInvalid = errors.New("config: invalid configuration")

// Problems is the error returned when a config has at least one problem of
// severity SevError. It lists every problem found, not only the first.
type Problems []Problem

// Error lists every problem, one per line.
func (ps Problems) Error() string {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.String()
	}
	return strings.Join(lines, "\n")
}

// Is makes errors.Is(err, ErrInvalid) true.
func (ps Problems) Is(target error) bool { return target == ErrInvalid }

// collector accumulates problems for one file.
type collector struct {
	file     string
	problems []Problem
}

func (c *collector) add(sev Severity, line, col int, path, format string, args ...any) {
	c.problems = append(c.problems, Problem{Severity: sev, File: c.file, Line: line, Col: col, Path: path, Msg: fmt.Sprintf(format, args...)})
}

// warn adds a warning of a kind.
func (c *collector) warn(kind string, line, col int, path, format string, args ...any) {
	c.problems = append(c.problems, Problem{Severity: SevWarning, File: c.file, Line: line, Col: col, Path: path,
		Msg: fmt.Sprintf(format, args...), Kind: kind})
}

// envWarn adds a warning about an environment variable (no file position).
func (c *collector) envWarn(kind, name, format string, args ...any) {
	c.problems = append(c.problems, Problem{Severity: SevWarning, Path: "env " + name, Msg: fmt.Sprintf(format, args...), Kind: kind})
}

// envErr adds an error about an environment variable's value.
func (c *collector) envErr(name, format string, args ...any) {
	c.problems = append(c.problems, Problem{Severity: SevError, Path: "env " + name, Msg: fmt.Sprintf(format, args...)})
}

func (c *collector) errs() Problems {
	return filter(c.problems, func(p Problem) bool { return p.Severity == SevError })
}

func (c *collector) warnings() []Problem {
	return filter(c.problems, func(p Problem) bool { return p.Severity == SevWarning })
}

// filter returns the problems of ps that keep accepts.
func filter(ps []Problem, keep func(Problem) bool) []Problem {
	var out []Problem
	for _, p := range ps {
		if keep(p) {
			out = append(out, p)
		}
	}
	return out
}
