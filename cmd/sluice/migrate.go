package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/sql/migrations"
)

func runMigrate(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dbURL := fs.String("database-url", controlplane.DefaultDatabaseURL, "Postgres URL")
	if err := parseEnvFlags(fs, args, getenv, nil); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, *dbURL)
	if err != nil {
		return fmt.Errorf("connect postgres: %w", err)
	}
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool)
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintf(stdout, "schema is up to date (version %d)\n", migrations.Latest())
		return nil
	}
	fmt.Fprintf(stdout, "applied migrations %v; schema at version %d\n", applied, migrations.Latest())
	return nil
}
