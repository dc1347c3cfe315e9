package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/internal/gctune"
)

// proxyEnvAliases are the variables `sluice proxy` read before every flag
// had its SLUICE_<FLAG> one; still honoured.
var proxyEnvAliases = envAliases{"addr": "SLUICE_PROXY_ADDR"}

func runProxy(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", dataplane.DefaultAddr, "HTTP listen address")
	region := fs.String("region", dataplane.DefaultRegion, "region whose configuration to run")
	natsURL := fs.String("nats-url", dataplane.DefaultNATSURL, "NATS server")
	instance := fs.String("instance-id", "", "instance name in heartbeats (default: host, pid and a random suffix)")
	maxStale := fs.Duration("max-staleness", dataplane.DefaultMaxStaleness, "serve at most this long without contact with the control plane")
	maxRejecting := fs.Duration("max-rejecting", dataplane.DefaultMaxRejecting,
		"refusing the region's current snapshot (running an older one) for longer than this fails /readyz")
	jwksStale := fs.Duration("jwks-max-stale", dataplane.DefaultJWKSMaxStale,
		"use a JWT issuer's last good signing keys at most this long while its JWKS cannot be fetched")
	jwksRefresh := fs.Duration("jwks-refresh-interval", dataplane.DefaultJWKSRefreshInterval, "fetch the signing keys of the JWT issuers in use this often")
	policy := fs.String("stale-policy", dataplane.StalePolicyReject, "past max staleness: reject (503 stale_config) or serve")
	spoolDir := fs.String("usage-spool-dir", "",
		"directory where usage events wait when the buffer is full or NATS is away; one per instance, persistent to survive restarts (default: a new temporary directory)")
	bufSize := fs.Int("usage-buffer-size", dataplane.DefaultUsageBufferSize, "usage events buffered in memory before spooling to disk")
	batchEvents := fs.Int("usage-batch-events", dataplane.DefaultUsageBatchEvents,
		"most usage events per JetStream message (1: one event per message, the format control planes before batches read)")
	maxBody := fs.Int64("max-body-bytes", dataplane.DefaultMaxBodyBytes, "largest OpenAI request body; larger answers 413 request_too_large")
	timeout := fs.Duration("request-timeout", dataplane.DefaultRequestTimeout, "total deadline of one OpenAI request across all attempts, streaming included")
	queues := fs.String("admission-queues", dataplane.DefaultAdmissionQueues,
		"per-class admission queue bounds, class=length/timeout (length 0: no queue, an immediate 503); model groups and deployments override them")
	queueRetry := fs.Duration("admission-retry-interval", dataplane.DefaultAdmissionRetryInterval,
		"a queued request tries for a slot at least this often (bounds the wait added for a slot freed by another proxy)")
	retries := fs.Int("max-retries", dataplane.DefaultMaxRetries, "other deployments a request may try after a connect error or 502/503/504 before the first byte (0: none)")
	ttft := fs.Duration("ttft-timeout", dataplane.DefaultTTFTTimeout,
		"abandon a stream attempt that relayed nothing (no first event) for this long and try another deployment (0: off)")
	budget := fs.Float64("retry-budget", dataplane.DefaultRetryBudgetRatio,
		"retries of a model group add at most this fraction of its requests over a sliding 10 s window; over it the original error is answered")
	budgetMin := fs.Int("retry-budget-min", dataplane.DefaultRetryBudgetMin, "retries per window a model group always may make, whatever its traffic")
	maxEject := fs.Int("max-ejection-percent", dataplane.DefaultMaxEjectionPercent,
		"largest share (percent) of a model group's deployments that ejections and Retry-After parkings take out at once (at least one, never all)")
	parkMax := fs.Duration("park-max", dataplane.DefaultParkMax, "cap of a deployment's parking for an engine's Retry-After, whatever it asks")
	ejectBase := fs.Duration("ejection-base", dataplane.DefaultEjectionBase, "first ejection of a deployment after consecutive failures, doubling up to --ejection-max while it keeps failing (a model group may override it)")
	ejectMax := fs.Duration("ejection-max", dataplane.DefaultEjectionMax, "longest ejection of a failing deployment (a model group may override it)")
	probation := fs.Bool("stream-probation", true,
		"hold back streams to a deployment this proxy has not yet seen stream cleanly (fresh start, new deployment, after a cut or ejection) until one proves it, at most 2 s, so a cut within the hold is retried elsewhere (false: only a half-open probe's stream is held)")
	panicPct := fs.Int("panic-threshold", 0, "when more than this percent of a model group's deployments is out, route to all of them as if healthy (0: off; a model group may override it)")
	hcInterval := fs.Duration("health-check-interval", dataplane.DefaultHealthCheckInterval,
		"interval of the active health checks of every engine's /health (0: off)")
	hcTimeout := fs.Duration("health-check-timeout", dataplane.DefaultHealthCheckTimeout, "deadline of one health check")
	hcUnhealthy := fs.Int("health-check-unhealthy", dataplane.DefaultHealthCheckUnhealthy, "failed health checks in a row that take a deployment out of rotation")
	hcHealthy := fs.Int("health-check-healthy", dataplane.DefaultHealthCheckHealthy, "passed health checks in a row that bring it back")
	emInterval := fs.Duration("engine-metrics-interval", dataplane.DefaultEngineMetricsInterval,
		"interval of the polls of the engines' /metrics for model groups with the engine_load strategy (0: off; they then order by fleet-wide in-flight requests)")
	emMaxAge := fs.Duration("engine-metrics-max-age", dataplane.DefaultEngineMetricsMaxAge,
		"age past which an engine's /metrics sample is ignored (engine_load falls back to the fleet-wide in-flight count)")
	redisURL := fs.String("redis-url", dataplane.DefaultRedisURL,
		"limits store, redis://[user:password@]host:port/db, rediss:// or unix:///path?db=n")
	redisCluster := fs.String("redis-cluster", "",
		"comma-separated Redis Cluster seed addresses; replaces --redis-url")
	redisPrefix := fs.String("redis-key-prefix", dataplane.DefaultRedisKeyPrefix,
		"prefix of every limits key; data planes that share limits share it")
	callTimeout := fs.Duration("limits-call-timeout", dataplane.DefaultLimitsCallTimeout,
		"deadline of every limits-store call; slower counts as unavailable and fails closed")
	leaseTTL := fs.Duration("lease-ttl", dataplane.DefaultLeaseTTL,
		"life of a concurrency slot without renewal: how fast a killed proxy's slots come back")
	fallback := fs.String("rate-limit-fallback", dataplane.RateFallbackClosed,
		"rpm/tpm while Redis is unavailable: closed (503 limits_unavailable) or local (limit ÷ live data planes); budgets and concurrency always fail closed")
	slicesOn := fs.Bool("limit-slices", true,
		"quota slices (--limit-slices=false: exact per-request admission only): admit hot scopes with large rpm/tpm, concurrency and budget limits from slices of the fleet-wide limits this proxy holds, without a Redis round trip (docs/limits.md)")
	ietfHeaders := fs.Bool("ietf-rate-limit-headers", false,
		"add the IETF RateLimit and RateLimit-Policy fields (draft-ietf-httpapi-ratelimit-headers) to the x-ratelimit-* headers of answers to requests with rpm/tpm limits")
	seedWait := fs.Duration("budget-seed-wait", dataplane.DefaultBudgetSeedWait,
		"longest wait of a request while budgets the limits store does not hold (first use, or Redis lost its state) are re-seeded from the control plane's ledger; past it 503 limits_recovering")
	readHeader := fs.Duration("read-header-timeout", dataplane.DefaultReadHeaderTimeout, "longest time a client may take to send a request's headers")
	idle := fs.Duration("idle-timeout", dataplane.DefaultIdleTimeout, "close client connections (HTTP/1.1 and h2c) without a request in flight for this long")
	bodyTimeout := fs.Duration("body-read-timeout", dataplane.DefaultBodyReadTimeout, "longest time a request body may take to arrive; later answers 408 request_body_timeout")
	bodyReads := fs.Int("max-body-reads", dataplane.DefaultMaxBodyReads, "request bodies read at once by this instance; more answer 503 body_reads_saturated")
	connReads := fs.Int("max-body-reads-per-conn", dataplane.DefaultMaxBodyReadsPerConn, "request bodies read at once on one connection (h2c); more answer 429 too_many_concurrent_bodies")
	h2Streams := fs.Int("h2-max-concurrent-streams", dataplane.DefaultH2MaxConcurrentStreams, "streams an h2c client may have open on one connection")
	defMaxOut := fs.Int64("default-max-output-tokens", dataplane.DefaultMaxOutputTokens,
		"output bound for token estimates and budget reservations of requests without max_tokens on deployments without max_output_tokens")
	gcFloor := fs.Int64("gc-heap-floor", dataplane.DefaultGCHeapFloor,
		"while the live heap is small, let the heap grow to about this many bytes before the garbage collector runs (GOGC raised; 0: GOGC alone)")
	pprofAddr := pprofFlag(fs)
	pprofLabels := fs.Bool("pprof-labels", false,
		"label request goroutines in CPU profiles with their org and key (pprof labels org, key; needs --pprof-addr)")
	level, format := logFlags(fs, defaultLogFormat)
	if err := parseEnvFlags(fs, args, getenv, proxyEnvAliases); err != nil {
		return err
	}
	if err := checkPprofAddr(*pprofAddr); err != nil {
		return err
	}
	if *pprofLabels && *pprofAddr == "" {
		return errors.New("--pprof-labels: labels only show in profiles served by --pprof-addr; set it too")
	}
	if *budget <= 0 || *budget > 1 {
		return fmt.Errorf("--retry-budget %g: must be within (0, 1] (retries are turned off with --max-retries=0)", *budget)
	}
	if *maxEject < 1 || *maxEject > 100 {
		return fmt.Errorf("--max-ejection-percent %d: must be within 1–100", *maxEject)
	}
	if *parkMax <= 0 {
		return fmt.Errorf("--park-max %s: must be positive", *parkMax)
	}
	if *ejectBase <= 0 || *ejectMax < *ejectBase {
		return fmt.Errorf("--ejection-base %s must be positive and --ejection-max %s not below it", *ejectBase, *ejectMax)
	}
	if *panicPct < 0 || *panicPct > 100 {
		return fmt.Errorf("--panic-threshold %d: must be within 0–100", *panicPct)
	}
	if *hcInterval < 0 || *hcTimeout <= 0 || *hcUnhealthy < 1 || *hcHealthy < 1 {
		return fmt.Errorf("--health-check-interval %s must not be negative, --health-check-timeout %s must be positive, thresholds %d/%d at least 1",
			*hcInterval, *hcTimeout, *hcUnhealthy, *hcHealthy)
	}
	if *emInterval < 0 || *emMaxAge <= 0 {
		return fmt.Errorf("--engine-metrics-interval %s must not be negative, --engine-metrics-max-age %s must be positive", *emInterval, *emMaxAge)
	}
	if *budgetMin < 1 {
		return fmt.Errorf("--retry-budget-min %d: must be at least 1", *budgetMin)
	}
	if *gcFloor < 0 {
		return fmt.Errorf("--gc-heap-floor %d: must not be negative (0 leaves the collector to GOGC alone)", *gcFloor)
	}
	var clusterAddrs []string
	for _, a := range strings.Split(*redisCluster, ",") {
		if a = strings.TrimSpace(a); a != "" {
			clusterAddrs = append(clusterAddrs, a)
		}
	}
	log, err := newLogger(stderr, *level, *format)
	if err != nil {
		return err
	}
	pepper, err := secret(getenv, "SLUICE_KEY_PEPPER")
	if err != nil {
		return err
	}
	kek, err := secret(getenv, "SLUICE_KEK")
	if err != nil {
		return err
	}
	dp, err := dataplane.New(ctx, dataplane.Config{
		Region: *region, InstanceID: *instance, NATSURL: *natsURL, Addr: *addr, MaxStaleness: *maxStale,
		StalePolicy: *policy, MaxRejecting: *maxRejecting, JWKSMaxStale: *jwksStale, JWKSRefreshInterval: *jwksRefresh, KeyPepper: pepper, KEK: kek, Logger: log,
		UsageSpoolDir: *spoolDir, UsageBufferSize: *bufSize, UsageBatchEvents: *batchEvents,
		MaxBodyBytes: *maxBody, RequestTimeout: *timeout, MaxRetries: *retries, NoRetries: *retries == 0,
		TTFTTimeout: *ttft, NoTTFTTimeout: *ttft == 0, RetryBudgetRatio: *budget, RetryBudgetMin: *budgetMin,
		MaxEjectionPercent: *maxEject, ParkMax: *parkMax, EjectionBase: *ejectBase, EjectionMax: *ejectMax, PanicThresholdPercent: *panicPct,
		NoStreamProbation:   !*probation,
		HealthCheckInterval: *hcInterval, NoHealthChecks: *hcInterval == 0, HealthCheckTimeout: *hcTimeout,
		HealthCheckUnhealthy: *hcUnhealthy, HealthCheckHealthy: *hcHealthy,
		EngineMetricsInterval: *emInterval, NoEngineMetrics: *emInterval == 0, EngineMetricsMaxAge: *emMaxAge,
		RedisURL: *redisURL, RedisClusterAddrs: clusterAddrs, RedisKeyPrefix: *redisPrefix,
		LimitsCallTimeout: *callTimeout, LeaseTTL: *leaseTTL, RateLimitFallback: *fallback, NoLimitSlices: !*slicesOn, IETFRateLimitHeaders: *ietfHeaders,
		DefaultMaxOutputTokens: *defMaxOut, BudgetSeedWait: *seedWait,
		ReadHeaderTimeout: *readHeader, IdleTimeout: *idle, BodyReadTimeout: *bodyTimeout,
		MaxBodyReads: *bodyReads, MaxBodyReadsPerConn: *connReads, H2MaxConcurrentStreams: *h2Streams,
		AdmissionQueues: *queues, AdmissionRetryInterval: *queueRetry, ProfileLabels: *pprofLabels,
	})
	if err != nil {
		return err
	}
	if *gcFloor > 0 {
		stopGC, err := gctune.Start(uint64(*gcFloor))
		switch {
		case errors.Is(err, gctune.ErrGCOff):
			log.Warn("GOGC=off: --gc-heap-floor is not applied; the collector runs only at GOMEMLIMIT")
		case err != nil:
			return err
		default:
			defer stopGC()
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	waitPprof, err := startPprof(ctx, *pprofAddr, log)
	if err != nil {
		return err
	}
	defer waitPprof()
	defer cancel()
	return dp.Run(ctx)
}
