package main

import (
	"context"
	"flag"
	"io"

	"github.com/sluicegw/sluice/controlplane"
)

// controlEnvAliases are the variables `sluice control` read before every
// flag had its SLUICE_<FLAG> one; still honoured.
var controlEnvAliases = envAliases{"addr": "SLUICE_ADMIN_ADDR", "read-timeout": "SLUICE_ADMIN_READ_TIMEOUT"}

func runControl(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice control", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", controlplane.DefaultAdminAddr, "admin API listen address")
	dbURL := fs.String("database-url", controlplane.DefaultDatabaseURL, "Postgres URL")
	natsURL := fs.String("nats-url", controlplane.DefaultNATSURL, "NATS server with JetStream")
	instance := fs.String("instance-id", "", "name of this replica (default: host name and pid)")
	migrate := fs.Bool("migrate", false, "apply pending migrations at start; without it an out-of-date schema stops the start")
	maxReq := fs.Int("max-request-bytes", controlplane.DefaultAdminMaxRequestBytes,
		"largest admin request body; a larger one is refused (resource_exhausted) before it is read")
	readTimeout := fs.Duration("read-timeout", controlplane.DefaultAdminReadTimeout, "longest time to read one admin request, headers and body")
	auditRetention := fs.Duration("audit-retention", auditRetentionDefault, "how long the audit export stream in JetStream keeps audit records")
	pprofAddr := pprofFlag(fs)
	level, format := logFlags(fs, defaultLogFormat)
	if err := parseEnvFlags(fs, args, getenv, controlEnvAliases); err != nil {
		return err
	}
	log, err := newLogger(stderr, *level, *format)
	if err != nil {
		return err
	}
	if err := checkPprofAddr(*pprofAddr); err != nil {
		return err
	}
	bootstrap, err := secret(getenv, "SLUICE_ADMIN_TOKEN")
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
	cp, err := controlplane.New(ctx, controlplane.Config{
		DatabaseURL: *dbURL, AdminAddr: *addr, NATSURL: *natsURL, InstanceID: *instance, BootstrapToken: bootstrap, KeyPepper: pepper, KEK: kek,
		Migrate: *migrate, Logger: log, AdminMaxRequestBytes: *maxReq, AdminReadTimeout: *readTimeout,
		AuditRetention: *auditRetention,
	})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	waitPprof, err := startPprof(ctx, *pprofAddr, log)
	if err != nil {
		return err
	}
	defer waitPprof()
	defer cancel()
	return cp.Run(ctx)
}

// auditRetentionDefault is the SLUICE_AUDIT stream's default retention.
const auditRetentionDefault = controlplane.DefaultAuditRetention
