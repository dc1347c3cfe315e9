package main

import (
	"context"
	"flag"
	"fmt"
	"io"
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
	level, format := logFlags(fs, getenv, "json")
	if err := parseFlags(fs, args); err != nil {
		return err
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
