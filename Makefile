# Sluice developer targets. Everything installs through the Go module proxy at
# pinned versions; nothing is installed by hand.
SHELL := /bin/bash
GO ?= go
BUF_VERSION := v1.75.0
SQLC_VERSION := v1.31.1
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_CONNECT_GO_VERSION := v1.19.1
TOOLS_DIR ?= $(HOME)/.cache/sluice-tools/$(BUF_VERSION)-$(SQLC_VERSION)-$(PROTOC_GEN_GO_VERSION)-$(PROTOC_GEN_CONNECT_GO_VERSION)
TOOLS_BIN := $(TOOLS_DIR)/bin
TEST_TIMEOUT ?= 15m
# golangci-lint has its own cache directory, keyed by its version, so a bump reinstalls it.
GOLANGCI_LINT_VERSION := v2.15.0
LINT_BIN := $(HOME)/.cache/sluice-tools/golangci-lint-$(GOLANGCI_LINT_VERSION)/bin

.PHONY: all generate tools services test test-short dev dev-load build build-static lint bench bench-distribution bench-limits bench-limits-split bench-limits-wire bench-humans-agents bench-fairness bench-usage bench-affinity bench-brownout fmt console-screenshots

all: build

$(TOOLS_BIN)/buf:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
$(TOOLS_BIN)/sqlc:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)
$(TOOLS_BIN)/protoc-gen-go:
	GOBIN=$(TOOLS_BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
$(TOOLS_BIN)/protoc-gen-connect-go:
	GOBIN=$(TOOLS_BIN) $(GO) install connectrpc.com/connect/cmd/protoc-gen-connect-go@$(PROTOC_GEN_CONNECT_GO_VERSION)

$(LINT_BIN)/golangci-lint:
	GOBIN=$(LINT_BIN) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)

tools: $(TOOLS_BIN)/buf $(TOOLS_BIN)/sqlc $(TOOLS_BIN)/protoc-gen-go $(TOOLS_BIN)/protoc-gen-connect-go

## generate: regenerate protobuf/Connect code and the sqlc store (output is committed).
generate: tools
	PATH="$(TOOLS_BIN):$$PATH" buf generate
	cd sql && $(TOOLS_BIN)/sqlc generate
	gofmt -w proto/gen controlplane/internal/store/dbsqlc

## console-screenshots: regenerate docs/console/*.png (one per console page, headless Chromium
## against a whole `sluice dev` system; listed in docs/console.md).
console-screenshots: services
	rm -f docs/console/*.png
	SLUICE_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(GO) test -count=1 -timeout 10m -run '^(TestConsoleInBrowser|TestConsoleRoutingPages)$$' ./cmd/sluice/

## services: check/start Postgres, Redis and NATS on this machine (idempotent).
services:
	bash deploy/local/services.sh

## test: the README's test command: services up, then every test with -race.
test: services
	$(GO) vet ./...
	GO=$(GO) TEST_TIMEOUT=$(TEST_TIMEOUT) bash .ci/test.sh

build:
	$(GO) build -o bin/ ./cmd/...

## build-static: the static binaries of the container image (deploy/Dockerfile runs the same command).
STATIC_OUT ?= bin/static/
build-static:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(STATIC_OUT) ./cmd/sluice ./cmd/sluicectl

## dev: run the whole system locally (see README). Builds first (with a
## message: the first build takes a minute or two), then runs the binary
## so Ctrl-C ends it cleanly. DEV_ARGS passes flags to `sluice dev`.
dev: services
	@echo "dev: building bin/sluice and bin/sluicectl (the first build takes a minute or two; later ones are cached) ..."
	@$(GO) build -o bin/ ./cmd/sluice ./cmd/sluicectl
	@echo "dev: starting bin/sluice dev $(DEV_ARGS)"
	@./bin/sluice dev $(DEV_ARGS)

## dev-load: with `make dev` running, the demo of a chat staying fast while coding agents share its
## engines: a chat probe alone, then 12 agent loops on the agent key (README "Run it"). DEV_LOAD_ARGS
## passes flags (--agents, --duration, ...).
dev-load:
	@$(GO) run ./e2e/cmd/dev-load $(DEV_LOAD_ARGS)

## lint: gofmt, go vet, then golangci-lint with .golangci.yml (errcheck, staticcheck, unused, errorlint,
## govet, ineffassign, depguard for the plane separation).
lint: $(LINT_BIN)/golangci-lint
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || (gofmt -l $$(git ls-files '*.go'); exit 1)
	$(GO) vet ./...
	$(LINT_BIN)/golangci-lint run ./...

fmt:
	gofmt -w $$(git ls-files '*.go')

## bench: long benchmarks, not run in CI.
bench: services
	$(GO) test -run '^$$' -bench . -benchtime 3x -timeout 60m ./...

## bench-distribution: config-distribution benchmarks (docs/distribution.md):
## revocation latency over 100 blocks, then the 100k-key snapshot.
bench-distribution: services
	$(GO) test -run '^$$' -bench '^BenchmarkRevocation$$' -benchtime 100x -count 1 -timeout 20m ./e2e/system/
	$(GO) test -run '^$$' -bench '^BenchmarkScale100kKeys$$' -benchtime 5x -count 1 -timeout 20m ./e2e/system/

## bench-proxy: proxy overhead in one run: direct vs httputil.ReverseProxy vs Sluice (docs/proxy.md).
## NATS and the control plane run as their own processes at nice 19; 3 interleaved rounds, medians.
bench-proxy: services
	SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-3} $(GO) test -run '^$$' -bench BenchmarkProxyOverhead -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-brownout: the issue-14 brownout through two data planes (docs/resilience.md): attempts per request,
## client errors by code, attempts by deployment standing, the 429er's requests while parked, the cutter's
## ejections and returns, the pool's out-of-rotation share, then the openai-go
## amplification check. SLUICE_BENCH_BROWNOUT_RATE (200/s) and SLUICE_BENCH_BROWNOUT_SECONDS (60) scale it.
bench-brownout: services
	$(GO) test -run '^$$' -bench '^BenchmarkBrownout$$' -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-limits: limits overhead in one run (docs/limits.md): a key without limits, a key limited at key, team and
## org level by every kind (windows kept full) and a rpm/tpm-only key, through an exact data plane and through a
## sliced one (quota slices), on a dedicated redis-server sharing the cores; asserts one Redis round trip before
## forwarding exactly (+ one settle after) and none from slices; 5 rounds, within each the keys of a data plane
## alternate request by request at c=1 and take 150 ms turns at c=64; the sliced data plane is measured twice per
## round, with net/http's client and with a wrk-like one (internal/rawhttp), and a third time as the `sluice proxy`
## binary (a process of its own, its flags at their defaults: --gc-heap-floor) with the wrk-like client; SLUICE_BENCH_
## GC_HEAP_FLOOR sets the in-process data planes' heap floor (bytes, default the proxy's; 0: GOGC alone), SLUICE_BENCH_
## PROXY_PPROF=127.0.0.1:port serves the binary's profiler (--pprof-labels: by key); reports each key's throughput against
## the key without limits on the same data plane and client (median of the rounds' ratios, min–max), added p50,
## CPU per request of the bench process, of the whole machine and of NATS, control plane and Postgres, allocations
## and Redis CPU per request, and per key and round the share of the cores a hypervisor gave to other guests (steal).
## SLUICE_BENCH_CPUPROFILE=file profiles the first group with the limited key.
bench-limits: services
	SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-5} $(GO) test -run '^$$' -bench '^BenchmarkLimitsOverhead$$' -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-humans-agents: people and coding agents on one shared pool (docs/traffic.md, "Measured"): 2 vllm-sim
## engines (max_num_seqs 8, max_num_batched_tokens 8192), 3 proxies, 12 agent loops and a chat probe every 0.5 s;
## chat TTFT idle / with classes / classes disabled / classes + prefill cap / classes + prefill isolation,
## agent tokens/s against agents alone, the fleet-wide agent cap.
## Scaled by SLUICE_BENCH_AGENTS, SLUICE_BENCH_WARMUP, SLUICE_BENCH_WINDOW, SLUICE_BENCH_IDLE.
bench-humans-agents: services
	$(GO) test -run '^$$' -bench '^BenchmarkHumansAgents$$' -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-fairness: two agent teams (10× the loops, 4× the prompts) backlogged for 60 s on 2 vllm-sim engines behind
## 3 proxies (docs/traffic.md, "Fairness within a class"): served token cost ratio (≤ 1.25), Jain index, engine occupancy (≥ 95 %).
bench-fairness: services
	$(GO) test -run '^$$' -bench '^BenchmarkAgentFairness$$' -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-affinity: prefix-cache hit ratio, agent tokens/s and in-flight balance, affinity vs weighted_shuffle,
## per-agent and shared system prompts, in one run (docs/routing.md, "Measured"): 16 agent loops, 4 vllm-sim engines, 3 proxies.
bench-affinity: services
	$(GO) test -run '^$$' -bench '^BenchmarkAffinity$$' -benchtime 1x -count 1 -timeout 20m -v ./e2e/system/

## bench-limits-split: the same with redis-server pinned to CPU 1 and everything else (data plane, load client,
## upstream, NATS, control plane) to CPU 0, so Redis stands in for another machine instead of taking the data
## plane's CPU.
bench-limits-split: services
	SLUICE_BENCH_REDIS_CPU=1 SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-5} taskset -c 0 $(GO) test -run '^$$' -bench '^BenchmarkLimitsOverhead$$' -benchtime 1x -timeout 20m -v ./e2e/system/

## bench-limits-wire: the sliced key's cost over loopback connections, in process (docs/limits.md, "The six header
## fields"): the key without limits, the same with the six x-ratelimit-* fields on its answers (the control), and the
## key limited by every kind at key, team and org level through quota slices, each with net/http's client and with a
## wrk-like one; 30 rounds of 2,000 requests each at c=64.
bench-limits-wire: services
	$(GO) test -run '^$$' -bench '^BenchmarkSlicedKeyWire$$' -benchtime 30x -timeout 20m ./dataplane/internal/gateway/

## bench-usage: NATS + control-plane CPU per usage event, one event per JetStream message vs batches
## (docs/ledger.md, "Batches"): NATS and the control plane as their own processes, 5,000 events/s for 5 s per
## phase, 3 interleaved rounds; reports both figures and their ratio (target ≤ 0.2).
bench-usage: services
	SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-3} $(GO) test -run '^$$' -bench '^BenchmarkUsageBatching$$' -benchtime 1x -timeout 20m -v ./e2e/system/
