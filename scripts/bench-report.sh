#!/bin/bash
# bench-report.sh: make bench-report. Runs every transfer benchmark the
# speed targets are stated for (each with its baselines in the same run)
# and the layout benchmarks, writes each report under docs/, then has
# cmd/perfreport check the targets and rewrite the README's summary between
# its bench-report markers. Run it on a quiet machine: every ratio is of two
# figures of one run, but a busy machine shifts one more than the other.
#
# The runs with baselines measure in ROUNDS rounds (kvxfer bench --rounds):
# round k measures every baseline, then every run, so that both sides are
# sampled at the same moments; each figure is the best of its rounds and
# the targets read the median of the per-round ratios. The small transfers
# have no baseline and absolute targets: they run once (a best of several
# rounds would flatter them).
set -euo pipefail
BIN=${BIN:-bin/kvxfer}
GO=${GO:-go}
ROUNDS=${ROUNDS:-3}
cd "$(dirname "$0")/.."

run() { echo "+ $*" >&2; "$@"; }

# Identical layouts, llama-3.1-8b: tcp, shm and ucx at three prompt
# lengths (the chart); the targets read the 4096-token rows.
run "$BIN" bench --model llama-3.1-8b --isl 1024,4096,16384 --backend tcp,shm,ucx --baseline --rounds "$ROUNDS" \
	--json docs/perf.json --md docs/perf.md --png docs/perf.png
# Context TP2 -> generation TP1 over tcp: scatter/gather from pool memory.
run "$BIN" bench --model llama-3.1-8b --isl 4096 --ctx-tp 2 --backend tcp --baseline --rounds "$ROUNDS" \
	--json docs/perf-tp2.json --md docs/perf-tp2.md
# UCX over its tcp transport, ucx_perftest with the same UCX_TLS.
echo "+ UCX_TLS=tcp" >&2
UCX_TLS=tcp run "$BIN" bench --model llama-3.1-8b --isl 4096 --backend ucx --baseline --rounds "$ROUNDS" \
	--json docs/perf-ucx-tcp.json --md docs/perf-ucx-tcp.md
# Small transfers: one 64 KiB block of the tiny model, one and eight at a time.
run "$BIN" bench --model tiny --isl 32 --requests 5000 --concurrency 1,8 --backend tcp,shm \
	--json docs/perf-small.json --md docs/perf-small.md
# Packing and unpacking against a plain copy of the same bytes.
LAYOUT_CMD="go test -run '^\$' -bench 'Pack|Unpack' -count 1 ./layout/"
echo "+ $LAYOUT_CMD" >&2
"$GO" test -run '^$' -bench 'Pack|Unpack' -count 1 ./layout/ | tee docs/perf-layout.txt >&2

run "$GO" run ./cmd/perfreport -readme README.md \
	-main docs/perf.json -tp2 docs/perf-tp2.json -ucx-tcp docs/perf-ucx-tcp.json -small docs/perf-small.json \
	-layout docs/perf-layout.txt -layout-command "$LAYOUT_CMD"
