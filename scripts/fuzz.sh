#!/usr/bin/env bash
# Runs every fuzz target of the module for $FUZZTIME each (default 5s), so
# that a new target is fuzzed in CI without anyone listing it.
set -euo pipefail
FUZZTIME=${FUZZTIME:-5s}
found=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for pkg in $(go list ./...); do
	for target in $(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true); do
		found=$((found + 1))
		echo "fuzz: $pkg $target ($FUZZTIME)"
		go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg" >"$log" 2>&1 || {
			cat "$log"
			echo "fuzz: $target failed; the failing input is under $(go list -f '{{.Dir}}' "$pkg")/testdata/fuzz/$target" >&2
			exit 1
		}
	done
done
echo "fuzz: $found targets, none failed"
