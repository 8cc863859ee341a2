#!/bin/bash
# benchcmp.sh BASE_REV [ROUNDS]: the transports' and layout's go test -bench
# figures of BASE_REV and of this working tree, in interleaved rounds (one
# round: every benchmark of one side, then every one of the other; the side
# that goes first alternates, since going second costs a few per cent here),
# compared with benchstat. BT sets -test.benchtime (default 8x). Interleaving
# keeps a noisy machine's drift out of the comparison; compare ratios within
# a run.
set -euo pipefail
export PATH=/usr/local/go/bin:$HOME/go/bin:$PATH
base=${1:?usage: scripts/benchcmp.sh BASE_REV [ROUNDS]}
rounds=${2:-4}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add -q --detach "$work/base" "$base"
command -v benchstat >/dev/null || go install golang.org/x/perf/cmd/benchstat@latest
declare -A pat=([layout]='Pack|Unpack|NewPlan' [transport/tcp]='Send$|RawTCP' [transport/shm]='Send$')
for side in base tree; do
	src=$root; [ $side = base ] && src=$work/base
	for p in "${!pat[@]}"; do (cd "$src" && go test -c -o "$work/$side-${p//\//-}.test" "./$p"); done
done
for round in $(seq "$rounds"); do
	order="base tree"; [ $((round % 2)) = 0 ] && order="tree base"
	for side in $order; do
		src=$root; [ $side = base ] && src=$work/base
		for p in "${!pat[@]}"; do
			(cd "$src/$p" && "$work/$side-${p//\//-}.test" -test.run '^$' -test.bench "${pat[$p]}" \
				-test.benchtime "${BT:-8x}" >>"$work/$side.txt" 2>&1)
		done
	done
done
benchstat "$work/base.txt" "$work/tree.txt"
