#!/usr/bin/env bash
# Installs the system packages kvxfer's build and tests need, only when
# missing, non-interactively. Needs root for apt-get.
set -euo pipefail

need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)   # cgo, for go test -race
dpkg -s libucx-dev >/dev/null 2>&1 || need+=(libucx-dev)   # the UCX backend (-tags ucx)
command -v ucx_perftest >/dev/null 2>&1 || need+=(ucx-utils) # its baseline in kvxfer bench
command -v iperf3 >/dev/null 2>&1 || need+=(iperf3)            # the TCP baselines in kvxfer bench
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)          # membership's etcd store, tested against a real etcd
command -v ip >/dev/null 2>&1 || need+=(iproute2)               # the cross-host test's network namespaces
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need+=(libopenmpi-dev) # the MPI backend (-tags mpi)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)          # its world: kvxfer up with backend MPI, make mpi
dpkg -s python3-numpy >/dev/null 2>&1 || need+=(python3-numpy)   # the Python binding's tests (make test-lib)
dpkg -s python3-pytest >/dev/null 2>&1 || need+=(python3-pytest) # idem

if ((${#need[@]})); then
	if [[ $(id -u) -ne 0 ]]; then
		echo "deps: missing ${need[*]} and not root: install them with apt-get" >&2
		exit 1
	fi
	echo "deps: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# The OpenAI client test runs the openai npm package on the machine's Node.js.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	if [[ $(id -u) -ne 0 ]]; then
		echo "deps: node/npm missing and not root: install nodejs and npm" >&2
		exit 1
	fi
	echo "deps: installing nodejs npm"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends nodejs npm
fi
here=$(cd "$(dirname "$0")/.." && pwd)
if [[ ! -d $here/tests/node/node_modules/openai ]]; then
	echo "deps: installing the openai npm package for the client test"
	(cd "$here/tests/node" && npm ci --no-audit --no-fund --loglevel=error)
fi

if ! command -v go >/dev/null 2>&1; then
	echo "deps: go not found on PATH (expected /usr/local/go/bin/go, Go 1.26)" >&2
	exit 1
fi
