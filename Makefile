# kvxfer — see README.md. `make help` lists the targets.

SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(HOME)/go/bin:$(PATH)
GO        ?= go
PKGS      := ./...
BIN       := bin/kvxfer
REVISION  := $(shell git rev-parse --short=12 HEAD 2>/dev/null)
DIRTY     := $(shell git status --porcelain 2>/dev/null | grep -q . && echo -dirty)
LDFLAGS   := -X github.com/kvxfer/kvxfer/internal/buildinfo.Revision=$(REVISION)$(DIRTY)
FUZZTIME  ?= 5s
# The UCX and MPI backends are cgo on libucx and OpenMPI; make deps installs
# libucx-dev and libopenmpi-dev, so builds include them.
TAGS      := ucx,mpi
# mpirun, allowed to run as root only through OpenMPI's own variables.
MPIRUN    := $(if $(filter 0,$(shell id -u)),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 )mpirun

CHAOS_SEED ?= 0

.PHONY: lib test-lib help run test hostile chaos bench-report bench-serve ucx mpi deps fmt-check vet staticcheck unit invariants fuzz-short nocgo build clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

run: build ## the main job: start a local disaggregated cluster (context TP2 -> generation TP1) behind an OpenAI-compatible router on :8000
	./$(BIN) up

test: deps fmt-check vet staticcheck unit ucx mpi invariants fuzz-short nocgo test-lib ## every check and test (installs what it needs)
	@echo "make test: all checks passed"

deps: ## install missing system packages (root, non-interactive, only when missing)
	@scripts/deps.sh

build: deps ## build bin/kvxfer
	$(GO) build -tags $(TAGS) -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/kvxfer

lib: ## build the C ABI: lib/libkvxfer.so for include/kvxfer.h (hand-written; cgo's generated header is removed)
	$(GO) build -buildmode=c-shared -ldflags "$(LDFLAGS)" -o lib/libkvxfer.so ./cmd/libkvxfer
	rm -f lib/libkvxfer.h

test-lib: deps lib ## the library: the C and Python examples (separate processes, bit-exact) and the Python binding's pytest suite (ranks in their own processes)
	@mkdir -p bin
	gcc -Wall -Wextra -Werror -O2 -Iinclude examples/c/transfer.c -Llib -lkvxfer -Wl,-rpath,'$$ORIGIN/../lib' -o bin/transfer
	./bin/transfer
	KVXFER_CLUSTER_SECRET=$$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n') ./bin/transfer
	KVXFER_LIB=$(CURDIR)/lib/libkvxfer.so PYTHONPATH=$(CURDIR)/python /usr/bin/python3 examples/python/transfer.py
	KVXFER_LIB=$(CURDIR)/lib/libkvxfer.so /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests

fmt-check: ## fail if any file is not gofmt-ed
	@out="$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))"; \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet: ## go vet (and of the chaos suite's build of kvxfer, -tags chaos)
	$(GO) vet $(PKGS)
	$(GO) vet -tags chaos ./cmd/kvxfer/

staticcheck: ## staticcheck, pinned by the tool directive in go.mod
	$(GO) tool staticcheck $(PKGS)
	$(GO) tool staticcheck -tags chaos ./cmd/kvxfer/

unit: ## go test -race -shuffle=on (with the short chaos suite, tests/chaos: about a minute)
	KVXFER_REQUIRE_NODE=1 KVXFER_REQUIRE_ETCD=1 $(GO) test -race -shuffle=on -count=1 -timeout 20m $(PKGS)

hostile: ## only the hostile-client suite (README, Security); make test runs it too
	$(GO) test -race -count=1 -run 'Hostile|PeerAllowList|FloodAfterHello|ControlHandshakeTimeout|KeepAliveFlood|ConnectionCaps?$$|TLSRefus|WorkerTLS|ServeBindsOnlyTheConfiguredHost|DataCheck|FloodLogBounded|AnnouncedLengthNotAllocated|AcceptedHelloNotKept|AbortReachesStalledReceiver|LateAbortEnds|GiveUpOnePart|GiveUpStalledReceiver|GiveUpOnKill|BlockingDescriptors|SilentConnections|ManySendersAtOnce|StalledReaderReleased|SlowBodyRefused|OversizeBody413|WorkerRefusesTrailingData|UpstreamAnswerOverMaxBody|KVEventsDrainReaderStuck|RouterModelsNoWorkerOrStalled|ReuseSaltsNeverShare|BuiltInStoreNoSecretLoopbackMembers|HTTPProxiedWithoutToken|HTTPPollsSpareTheRouter|HTTPPutNeedsLease|ViewBadRecordsLogBounded|BuffersHoldLimit|IdleConnectionsClosed|IdleSenderRetiresFirst|IdleLongSend|ReusePoisonedPromptRefused|WorkerReuseRoutesAuth|WorkerReusesPrefixesPerSalt|RecordValidate|RouterUpstreamOddStatus' ./...

chaos: ## the long chaos suite (README, Reliability): workers and router under faults, about 8 minutes; prints the figures table (CHAOS_SEED=N repeats a run)
	@mkdir -p bin && rm -f bin/chaos-figures.md
	$(GO) test -count=1 -timeout 15m -run 'TestChaosLong|TestFaultyTransceiver' ./tests/chaos/ \
		-args -chaos.long -chaos.seed=$(CHAOS_SEED) -chaos.table=$(CURDIR)/bin/chaos-figures.md
	@cat bin/chaos-figures.md

ucx: deps ## the UCX backend: vet, staticcheck and race tests with -tags ucx, and the transceiver, bench, serve and the cross-host test over UCX
	$(GO) vet -tags ucx ./transport/... ./internal/cli/ ./transceiver/ ./bench/ ./serve/
	$(GO) tool staticcheck -tags ucx ./transport/ucx/ ./internal/cli/ ./transceiver/ ./bench/ ./serve/
	$(GO) test -tags ucx -race -shuffle=on -count=1 -timeout 10m ./transport/ucx/
	$(GO) test -tags ucx -race -count=1 -timeout 10m -run 'UCX|TestPairings|TestAutoPicks' ./transceiver/ ./bench/ ./serve/
	$(GO) test -tags ucx -count=1 -timeout 10m -run 'TestCrossHost' ./tests/crosshost/ -args -crosshost.backends=UCX,AUTO

mpi: deps ## the MPI backend: vet, staticcheck, its transport's race tests on two ranks of mpirun, kvxfer up --smoke over one MPI world, and kvxfer bench --backend mpi
	$(GO) vet -tags mpi ./transport/... ./internal/cli/ ./internal/launch/ ./bench/
	$(GO) tool staticcheck -tags mpi ./transport/mpi/ ./internal/cli/ ./internal/launch/ ./bench/
	@mkdir -p bin
	$(GO) test -tags mpi -race -c -o bin/mpi.test ./transport/mpi/
	cd transport/mpi && $(MPIRUN) -np 2 --bind-to none --oversubscribe ../../bin/mpi.test -test.count=1 -test.timeout=5m
	$(GO) test -tags mpi -race -count=1 -timeout 10m -run 'TestUpSmokeMPI|TestVersionAndBackends|TestServeMPI|TestBenchMPI' ./internal/cli/

invariants: ## the packages that have an invariants build tag, tested with it
	@pkgs="$$(grep -rl --include='*.go' '^//go:build invariants' . | xargs -r -n1 dirname | sort -u)"; \
	if [ -n "$$pkgs" ]; then echo "go test -tags invariants $$pkgs"; $(GO) test -tags invariants -count=1 $$pkgs; fi

fuzz-short: ## every fuzz target for FUZZTIME (default 5s)
	@FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

nocgo: ## the binary builds without cgo (UCX and MPI then report themselves as not built in)
	CGO_ENABLED=0 $(GO) build $(PKGS)
	CGO_ENABLED=0 $(GO) build -tags ucx,mpi $(PKGS)

bench-report: build ## run every transfer and layout benchmark with its baselines (docs/perf*) and rewrite the README's performance summary
	BIN=$(BIN) GO=$(GO) scripts/bench-report.sh

bench-serve: build ## the README's serving figures (kvxfer bench serve): the default cluster and an aggregated worker at 1, 2, 4 and 8 requests/s of 1,024-token prompts; docs/serve-sweep.{json,md,png}
	./$(BIN) bench serve --compare-aggregated --rates 1,2,4,8 --num-prompts 32 --input-len 1024 --output-len 64 --duration 30s \
		--json docs/serve-sweep.json --md docs/serve-sweep.md --png docs/serve-sweep.png

clean: ## remove build outputs
	rm -rf bin lib

# Prefix-reuse figures (issue #18): scripts/bench-reuse.sh, the issue's full workload (50
# conversations × 6 turns per cluster, about 7 minutes); REUSE_CONVERSATIONS=20 is a quicker look.
REUSE_CONVERSATIONS ?= 50
.PHONY: bench-reuse
bench-reuse: build ## the README's prefix-reuse figures: reuse on/off, kv_cache_aware vs round_robin (2+2), conditional disaggregation, 6-turn conversations after a 1,000-token system prompt; docs/reuse.{json,md,png}
	BIN=$(BIN) CONVERSATIONS=$(REUSE_CONVERSATIONS) scripts/bench-reuse.sh
