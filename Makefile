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

.PHONY: all generate tools services test test-short dev build lint bench bench-distribution bench-limits bench-limits-split fmt

all: build

$(TOOLS_BIN)/buf:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
$(TOOLS_BIN)/sqlc:
	GOBIN=$(TOOLS_BIN) $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)
$(TOOLS_BIN)/protoc-gen-go:
	GOBIN=$(TOOLS_BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
$(TOOLS_BIN)/protoc-gen-connect-go:
	GOBIN=$(TOOLS_BIN) $(GO) install connectrpc.com/connect/cmd/protoc-gen-connect-go@$(PROTOC_GEN_CONNECT_GO_VERSION)

tools: $(TOOLS_BIN)/buf $(TOOLS_BIN)/sqlc $(TOOLS_BIN)/protoc-gen-go $(TOOLS_BIN)/protoc-gen-connect-go

## generate: regenerate protobuf/Connect code and the sqlc store (output is committed).
generate: tools
	PATH="$(TOOLS_BIN):$$PATH" buf generate
	cd sql && $(TOOLS_BIN)/sqlc generate
	gofmt -w proto/gen controlplane/internal/store/dbsqlc

## services: check/start Postgres, Redis and NATS on this machine (idempotent).
services:
	bash deploy/local/services.sh

## test: the README's test command: services up, then every test with -race.
test: services
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./...

build:
	$(GO) build -o bin/ ./cmd/...

## dev: run the whole system locally (see README).
dev: services
	$(GO) run ./cmd/sluice dev

lint:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || (gofmt -l $$(git ls-files '*.go'); exit 1)
	$(GO) vet ./...

fmt:
	gofmt -w $$(git ls-files '*.go')

## bench: long benchmarks, not run in CI.
bench: services
	$(GO) test -run '^$$' -bench . -benchtime 3x -timeout 60m ./...

## bench-distribution: config-distribution benchmarks (docs/distribution.md):
## revocation latency over 100 blocks, then the 100k-key snapshot.
bench-distribution: services
	$(GO) test -run '^$$' -bench '^BenchmarkRevocation$$' -benchtime 100x -count 1 -timeout 20m ./dataplane/
	$(GO) test -run '^$$' -bench '^BenchmarkScale100kKeys$$' -benchtime 5x -count 1 -timeout 20m ./dataplane/

## bench-proxy: proxy overhead in one run: direct vs httputil.ReverseProxy vs Sluice (docs/proxy.md).
## NATS and the control plane run as their own processes at nice 19; 3 interleaved rounds, medians.
bench-proxy: services
	SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-3} $(GO) test -run '^$$' -bench BenchmarkProxyOverhead -benchtime 1x -timeout 20m -v ./dataplane/

## bench-limits: limits overhead in one run (docs/limits.md): one data plane, a key without limits vs a key
## limited at key, team and org level (windows kept full), a dedicated redis-server; asserts one Redis round trip
## before forwarding (+ one settle after), reports throughput on/off at c=64 (target ≥ 0.8; the median of the
## rounds' paired ratios) and added p50; 5 interleaved rounds. SLUICE_BENCH_CPUPROFILE=file profiles a limited phase.
bench-limits: services
	SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-5} $(GO) test -run '^$$' -bench '^BenchmarkLimitsOverhead$$' -benchtime 1x -timeout 20m -v ./dataplane/

## bench-limits-split: the same with redis-server pinned to CPU 1 and everything else (data plane, load client,
## upstream, NATS, control plane) to CPU 0, so Redis stands in for another machine instead of taking the data
## plane's CPU.
bench-limits-split: services
	SLUICE_BENCH_REDIS_CPU=1 SLUICE_BENCH_ROUNDS=$${SLUICE_BENCH_ROUNDS:-5} taskset -c 0 $(GO) test -run '^$$' -bench '^BenchmarkLimitsOverhead$$' -benchtime 1x -timeout 20m -v ./dataplane/
