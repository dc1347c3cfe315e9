package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/sluicegw/sluice/dataplane"
)

func runProxy(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", envOr(getenv, "SLUICE_PROXY_ADDR", dataplane.DefaultAddr), "HTTP listen address (SLUICE_PROXY_ADDR)")
	region := fs.String("region", envOr(getenv, "SLUICE_REGION", dataplane.DefaultRegion), "region whose configuration to run (SLUICE_REGION)")
	natsURL := fs.String("nats-url", envOr(getenv, "SLUICE_NATS_URL", dataplane.DefaultNATSURL), "NATS server (SLUICE_NATS_URL)")
	instance := fs.String("instance-id", envOr(getenv, "SLUICE_INSTANCE_ID", ""), "instance name in heartbeats (default: host, pid and a random suffix)")
	defStale, err := durationEnv(getenv, "SLUICE_MAX_STALENESS", dataplane.DefaultMaxStaleness)
	if err != nil {
		return err
	}
	maxStale := fs.Duration("max-staleness", defStale, "serve at most this long without contact with the control plane (SLUICE_MAX_STALENESS)")
	policy := fs.String("stale-policy", envOr(getenv, "SLUICE_STALE_POLICY", dataplane.StalePolicyReject), "past max staleness: reject (503 stale_config) or serve (SLUICE_STALE_POLICY)")
	spoolDir := fs.String("usage-spool-dir", envOr(getenv, "SLUICE_USAGE_SPOOL_DIR", ""),
		"directory where usage events wait when the buffer is full or NATS is away; one per instance, persistent to survive restarts (default: a new temporary directory) (SLUICE_USAGE_SPOOL_DIR)")
	bufSize := fs.Int("usage-buffer-size", dataplane.DefaultUsageBufferSize, "usage events buffered in memory before spooling to disk")
	defTimeout, err := durationEnv(getenv, "SLUICE_REQUEST_TIMEOUT", dataplane.DefaultRequestTimeout)
	if err != nil {
		return err
	}
	maxBody := fs.Int64("max-body-bytes", dataplane.DefaultMaxBodyBytes, "largest OpenAI request body; larger answers 413 request_too_large")
	timeout := fs.Duration("request-timeout", defTimeout, "total deadline of one OpenAI request across all attempts, streaming included (SLUICE_REQUEST_TIMEOUT)")
	retries := fs.Int("max-retries", dataplane.DefaultMaxRetries, "other deployments a request may try after a connect error or 502/503/504 before the first byte (0: none)")
	redisURL := fs.String("redis-url", envOr(getenv, "SLUICE_REDIS_URL", dataplane.DefaultRedisURL),
		"limits store, redis://[user:password@]host:port/db, rediss:// or unix:///path?db=n (SLUICE_REDIS_URL)")
	redisCluster := fs.String("redis-cluster", envOr(getenv, "SLUICE_REDIS_CLUSTER", ""),
		"comma-separated Redis Cluster seed addresses; replaces --redis-url (SLUICE_REDIS_CLUSTER)")
	redisPrefix := fs.String("redis-key-prefix", envOr(getenv, "SLUICE_REDIS_KEY_PREFIX", dataplane.DefaultRedisKeyPrefix),
		"prefix of every limits key; data planes that share limits share it (SLUICE_REDIS_KEY_PREFIX)")
	callTimeout := fs.Duration("limits-call-timeout", dataplane.DefaultLimitsCallTimeout,
		"deadline of every limits-store call; slower counts as unavailable and fails closed")
	leaseTTL := fs.Duration("lease-ttl", dataplane.DefaultLeaseTTL,
		"life of a concurrency slot without renewal: how fast a killed proxy's slots come back")
	fallback := fs.String("rate-limit-fallback", envOr(getenv, "SLUICE_RATE_LIMIT_FALLBACK", dataplane.RateFallbackClosed),
		"rpm/tpm while Redis is unavailable: closed (503 limits_unavailable) or local (limit ÷ live data planes); budgets and concurrency always fail closed (SLUICE_RATE_LIMIT_FALLBACK)")
	defMaxOut := fs.Int64("default-max-output-tokens", dataplane.DefaultMaxOutputTokens,
		"output bound for token estimates and budget reservations of requests without max_tokens on deployments without max_output_tokens")
	level, format := logFlags(fs, getenv, "json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var clusterAddrs []string
	for _, a := range strings.Split(*redisCluster, ",") {
		if a = strings.TrimSpace(a); a != "" {
			clusterAddrs = append(clusterAddrs, a)
		}
	}
	if *retries == 0 {
		*retries = -1 // the data plane reads 0 as "default"
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
		StalePolicy: *policy, KeyPepper: pepper, KEK: kek, Logger: log,
		UsageSpoolDir: *spoolDir, UsageBufferSize: *bufSize,
		MaxBodyBytes: *maxBody, RequestTimeout: *timeout, MaxRetries: *retries,
		RedisURL: *redisURL, RedisClusterAddrs: clusterAddrs, RedisKeyPrefix: *redisPrefix,
		LimitsCallTimeout: *callTimeout, LeaseTTL: *leaseTTL, RateLimitFallback: *fallback,
		DefaultMaxOutputTokens: *defMaxOut,
	})
	if err != nil {
		return err
	}
	return dp.Run(ctx)
}

// durationEnv parses $name as a duration, or returns def when unset.
func durationEnv(getenv func(string) string, name string, def time.Duration) (time.Duration, error) {
	v := getenv(name)
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%s=%q: want a duration such as 60s", name, v)
	}
	return d, nil
}
