// Package testsvc gives tests isolated access to the machine's real
// services: a fresh, migrated Postgres database per call. Tests fail (not
// skip) when a service is missing.
package testsvc

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sluicegw/sluice/sql/migrations"
)

// AdminURL is the server-level database URL tests connect to; override
// with SLUICE_TEST_POSTGRES_URL.
func AdminURL() string {
	if u := os.Getenv("SLUICE_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// withDB returns AdminURL pointing at database name.
func withDB(name string) string {
	u := AdminURL()
	i := strings.Index(u, "://")
	rest := u[i+3:]
	slash := strings.Index(rest, "/")
	q := ""
	if j := strings.Index(rest, "?"); j >= 0 {
		q = rest[j:]
		if slash < 0 || slash > j {
			slash = j
		}
	}
	if slash < 0 {
		return u + "/" + name
	}
	return u[:i+3] + rest[:slash] + "/" + name + q
}

// templateName names the migrated template database for the current set
// of migrations, so a schema change makes a new template.
func templateName() (string, error) {
	all, err := migrations.All()
	if err != nil {
		return "", err
	}
	h := sha256.New()
	for _, m := range all {
		fmt.Fprintf(h, "%d\x00%s\x00%s\x00", m.Version, m.Name, m.Up)
	}
	return "sluice_tmpl_" + hex.EncodeToString(h.Sum(nil))[:16], nil
}

func ensureTemplate(ctx context.Context, admin *pgx.Conn, name string) error {
	// Serialise template creation across test processes.
	if _, err := admin.Exec(ctx, `SELECT pg_advisory_lock(7423001)`); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	defer func() { _, _ = admin.Exec(context.Background(), `SELECT pg_advisory_unlock(7423001)`) }()
	var exists bool
	if err := admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return err
	}
	if exists {
		return nil
	}
	building := name + "_build"
	if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+building); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+building); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, withDB(building))
	if err != nil {
		return err
	}
	_, err = migrations.Apply(ctx, pool)
	pool.Close()
	if err != nil {
		return fmt.Errorf("migrate template: %w", err)
	}
	_, err = admin.Exec(ctx, `ALTER DATABASE `+building+` RENAME TO `+name)
	return err
}

// NewDatabase creates a fresh, fully migrated database for this test and
// drops it at cleanup. It returns the database URL.
func NewDatabase(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		t.Fatalf("postgres is required for this test (start it with deploy/local/services.sh): %v", err)
	}
	defer admin.Close(context.Background())
	tmpl, err := templateName()
	if err != nil {
		t.Fatal(err)
	}
	if err := ensureTemplate(ctx, admin, tmpl); err != nil {
		t.Fatalf("template database: %v", err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "sluice_test_" + hex.EncodeToString(b[:])
	// CREATE DATABASE ... TEMPLATE fails while another session uses the
	// template; retry briefly (another test may be copying it too).
	for attempt := 0; ; attempt++ {
		_, err = admin.Exec(ctx, `CREATE DATABASE `+name+` TEMPLATE `+tmpl)
		if err == nil || attempt > 50 || !strings.Contains(err.Error(), "being accessed by other users") {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("create test database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, AdminURL())
		if err != nil {
			t.Errorf("drop test database: %v", err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
			t.Errorf("drop test database: %v", err)
		}
	})
	return withDB(name)
}

// NewPool returns a pool on a fresh database (see NewDatabase), closed at
// cleanup.
func NewPool(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	url := NewDatabase(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("connect test database: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, url
}

// BackupRestore takes an online backup of the database at srcURL with
// pg_dump (a consistent snapshot while other sessions keep writing, as an
// operator's backup is) and restores it with psql into a new database,
// dropped at cleanup. It returns the new database's URL. pg_dump and psql
// must be on PATH (the test fails otherwise).
func BackupRestore(t testing.TB, srcURL string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		t.Fatalf("postgres is required for this test: %v", err)
	}
	defer admin.Close(context.Background())
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "sluice_test_restored_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+name+` TEMPLATE template0`); err != nil {
		t.Fatalf("create database for the restore: %v", err)
	}
	t.Cleanup(func() { dropDatabase(t, name) })
	dst := withDB(name)
	dump := exec.CommandContext(ctx, "pg_dump", "--no-owner", "--no-privileges", "--dbname", srcURL)
	restore := exec.CommandContext(ctx, "psql", "--quiet", "--no-psqlrc", "-v", "ON_ERROR_STOP=1", "--dbname", dst)
	pipe, err := dump.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	restore.Stdin = pipe
	var dumpErr, restoreErr strings.Builder
	dump.Stderr, restore.Stderr = &dumpErr, &restoreErr
	restore.Stdout = io.Discard
	if err := restore.Start(); err != nil {
		t.Fatalf("psql is required for this test: %v", err)
	}
	if err := dump.Run(); err != nil {
		_ = restore.Wait()
		t.Fatalf("pg_dump: %v: %s", err, dumpErr.String())
	}
	if err := restore.Wait(); err != nil {
		t.Fatalf("psql restore: %v: %s", err, restoreErr.String())
	}
	return dst
}

func dropDatabase(t testing.TB, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		t.Errorf("drop test database: %v", err)
		return
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
		t.Errorf("drop test database: %v", err)
	}
}
