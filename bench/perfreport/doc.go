// Package perfreport checks the transfer benchmark's reports against the
// project's speed targets and writes the README's performance summary.
//
// make bench-report runs kvxfer bench several times (identical layouts,
// context TP2 → generation TP1, UCX with and without UCX_TLS=tcp, small
// transfers) and the layout benchmarks, each writing its own report; this
// package reads them (Inputs), evaluates every target on the figures of
// the run it names (Evaluate: each ratio is of two figures measured in one
// run; a report of several rounds, kvxfer bench --rounds, is judged on the
// median of its per-round ratios, for every ratio target alike), renders
// the result as a Markdown table that names the command behind every
// figure (Render), and replaces the part of the README between two marker
// lines with it (Splice). It does no measuring itself.
package perfreport
