#!/usr/bin/env bash
# Runs every fuzz target of the module for $FUZZTIME each (default 5s), so
# that a new target is fuzzed in CI without anyone listing it.
#
# Go 1.26's fuzz coordinator can end a run that found nothing with a bare
# "context deadline exceeded" at the -fuzztime boundary (go.dev/issue/75804,
# fixed in Go 1.27). A real finding always writes a reproducer under
# testdata/fuzz/<target>/ and prints it; so a failure counts when a
# reproducer appeared or the log shows anything but that bare deadline. A
# bare deadline is retried once, then reported as a flake without failing.
set -euo pipefail
FUZZTIME=${FUZZTIME:-5s}
found=0
flaked=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

corpus_count() { # dir target
	local d="$1/testdata/fuzz/$2"
	if [[ -d $d ]]; then find "$d" -type f | wc -l; else echo 0; fi
}

bare_deadline() { # the log shows no finding, only the coordinator's deadline
	grep -q 'context deadline exceeded' "$log" &&
		! grep -qE 'Failing input written|panic:|fuzz_test.go:[0-9]+:|_test.go:[0-9]+:' "$log"
}

# The targets are read from each package's test files as go list selects
# them (build tags and all): `go test -list` would link a test binary of
# every package, most of them without a target, only to name them.
targets() { # dir files...: the fuzz targets declared in the files
	local dir=$1
	shift
	(cd "$dir" && grep -ho '^func Fuzz[A-Za-z0-9_]*([A-Za-z0-9_]* \*testing\.F)' "$@" || true) |
		sed -E 's/^func (Fuzz[A-Za-z0-9_]*).*/\1/'
}

# A failing go list ends the script here (set -e), before any target.
listing=$(go list -f '{{.ImportPath}} {{.Dir}}{{range .TestGoFiles}} {{.}}{{end}}{{range .XTestGoFiles}} {{.}}{{end}}' ./...)
# The list comes on fd 3: go test and the fuzzers keep stdin.
while read -r pkg dir files <&3; do
	[[ -n $files ]] || continue
	# shellcheck disable=SC2086 # files: names without spaces, one word each
	for target in $(targets "$dir" $files); do
		found=$((found + 1))
		for attempt in 1 2; do
			before=$(corpus_count "$dir" "$target")
			echo "fuzz: $pkg $target ($FUZZTIME)"
			if go test -run '^$' -fuzz "^${target}\$" -fuzztime "$FUZZTIME" "$pkg" >"$log" 2>&1; then
				break
			fi
			after=$(corpus_count "$dir" "$target")
			if [[ $after -eq $before ]] && bare_deadline; then
				if [[ $attempt -eq 1 ]]; then
					echo "fuzz: $target: bare 'context deadline exceeded' with no reproducer (go.dev/issue/75804); retrying once"
					continue
				fi
				echo "fuzz: $target: flaked twice at the deadline with no reproducer; not a finding"
				flaked=$((flaked + 1))
				break
			fi
			cat "$log"
			echo "fuzz: $target failed; the failing input is under $dir/testdata/fuzz/$target" >&2
			exit 1
		done
	done
done 3<<<"$listing"
echo "fuzz: $found targets, none failed ($flaked deadline flakes)"
