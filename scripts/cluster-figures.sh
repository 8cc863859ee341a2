#!/usr/bin/env bash
# cluster-figures.sh [ROUNDS]: the dynamic-membership figures of the README
# (issue #15): kill -9 of a generation worker under load (time until the
# router stops routing to it, requests failed), a new worker taking traffic,
# a graceful leave, a router restart, and a rolling restart of 2+2 workers.
# It runs the process-level tests that measure them (real etcd, router and
# worker processes on loopback), ROUNDS times (default 3), and prints every
# figure line they log, per round. Run it on a quiet machine: the figures
# are times.
set -euo pipefail
export PATH=/usr/local/go/bin:$HOME/go/bin:$PATH
rounds=${1:-3}
root=$(git rev-parse --show-toplevel)
cd "$root"
scripts/deps.sh >/dev/null
for r in $(seq "$rounds"); do
	echo "== round $r"
	go test -count=1 -v -run 'TestDynamicMembership(Etcd|BuiltIn)$' ./internal/cli/ 2>&1 |
		grep -E 'membership_test.go:[0-9]+: (2\+2 workers|kill -9|generation-2 answered|SIGTERM|load:|restarted router|built-in store:)' |
		sed -E 's/^ *membership_test.go:[0-9]+: /  /' || true
	go test -count=1 -v -run 'TestRollingRestart$' ./tests/crosshost/ 2>&1 |
		grep -E 'rolling_test.go:[0-9]+: rolling restart' | sed -E 's/^ *rolling_test.go:[0-9]+: /  /' || true
done
