#!/bin/bash
# bench-reuse.sh: make bench-reuse. One kvxfer bench serve over the cluster
# files of examples/reuse/, each started, measured and stopped in turn with
# the same workload (issue #18's: conversations of 6 turns after a shared
# 1,000-token system prompt, each turn resending the history with the
# answers the server gave): block reuse off and on, the kv_cache_aware and
# round_robin routers on 2 context + 2 generation workers, and conditional
# disaggregation. It writes docs/reuse.{json,md,png} and the README's
# summary between its bench-reuse markers, the command beside every figure.
# Each cluster's run sends no request after 150 s: on a quiet 2-core machine
# the 50 conversations end before; a loaded one completes fewer (the report
# counts them).
set -euo pipefail
BIN=${BIN:-bin/kvxfer}
CONVERSATIONS=${CONVERSATIONS:-50}
TURNS=6
cd "$(dirname "$0")/.."

if [ "$CONVERSATIONS" -ne 50 ]; then
	echo "bench-reuse: $CONVERSATIONS conversations × $TURNS turns per cluster, not issue #18's 50; make bench-reuse runs the full workload" >&2
fi
set -x
"$BIN" bench serve \
	-f examples/reuse/reuse_off.yaml -f examples/reuse/reuse_on.yaml \
	-f examples/reuse/round_robin.yaml -f examples/reuse/kv_cache_aware.yaml \
	-f examples/reuse/conditional.yaml \
	--num-prompts $((CONVERSATIONS * TURNS)) --turns $TURNS --system-prompt-len 1000 \
	--input-len uniform:32-512 --output-len 32 --request-rate 1 --warmup 2 --seed 18 --duration 150s \
	--json docs/reuse.json --md docs/reuse.md --png docs/reuse.png --readme README.md
