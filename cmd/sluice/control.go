package main

import (
	"context"
	"flag"
	"io"

	"github.com/sluicegw/sluice/controlplane"
)

func runControl(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice control", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", envOr(getenv, "SLUICE_ADMIN_ADDR", controlplane.DefaultAdminAddr), "admin API listen address (SLUICE_ADMIN_ADDR)")
	dbURL := fs.String("database-url", envOr(getenv, "SLUICE_DATABASE_URL", controlplane.DefaultDatabaseURL), "Postgres URL (SLUICE_DATABASE_URL)")
	natsURL := fs.String("nats-url", envOr(getenv, "SLUICE_NATS_URL", controlplane.DefaultNATSURL), "NATS server with JetStream (SLUICE_NATS_URL)")
	instance := fs.String("instance-id", envOr(getenv, "SLUICE_INSTANCE_ID", ""), "name of this replica (default: host name and pid)")
	migrate := fs.Bool("migrate", envOr(getenv, "SLUICE_MIGRATE", "") == "true", "apply pending migrations at start (SLUICE_MIGRATE=true); without it an out-of-date schema stops the start")
	level, format := logFlags(fs, getenv, "json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	log, err := newLogger(stderr, *level, *format)
	if err != nil {
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
		Migrate: *migrate, Logger: log,
	})
	if err != nil {
		return err
	}
	return cp.Run(ctx)
}
