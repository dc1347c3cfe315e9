package controlplane

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	"github.com/sluicegw/sluice/sql/migrations"
)

const (
	pepper = "1:controlplane-test-pepper-0123456789abcdef"
	// kek is a 32-byte key ring entry (base64 of "controlplane-test-kek-0123456789").
	kek = "1:Y29udHJvbHBsYW5lLXRlc3Qta2VrLTAxMjM0NTY3ODk="
)

func emptyDatabase(t *testing.T) string {
	t.Helper()
	url := testsvc.NewDatabase(t)
	// NewDatabase is migrated; roll it back to empty for these tests.
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	defer pool.Close()
	all, err := migrations.All()
	require.NoError(t, err)
	for i := len(all) - 1; i >= 0; i-- {
		_, err := pool.Exec(context.Background(), all[i].Down)
		require.NoError(t, err)
	}
	_, err = pool.Exec(context.Background(), `DROP TABLE schema_migrations`)
	require.NoError(t, err)
	return url
}

func TestNewRefusesOutOfDateSchema(t *testing.T) {
	t.Parallel()
	url := emptyDatabase(t)
	ctx := context.Background()
	nats := testsvc.StartNATS(t)
	_, err := New(ctx, Config{DatabaseURL: url, AdminAddr: "127.0.0.1:0", KeyPepper: pepper, KEK: kek, NATSURL: nats.URL})
	require.Error(t, err)
	require.True(t, errors.Is(err, migrations.ErrOutOfDate), err)
	require.Contains(t, err.Error(), "--migrate")

	cp, err := New(ctx, Config{DatabaseURL: url, AdminAddr: "127.0.0.1:0", KeyPepper: pepper, KEK: kek, Migrate: true, NATSURL: nats.URL,
		BootstrapToken: strings.Repeat("b", 40)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- cp.Run(ctx) }()
	resp, err := http.Get("http://" + cp.Addr() + "/readyz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	// The admin API answers JSON over HTTP/1.1.
	req, _ := http.NewRequest(http.MethodPost, "http://"+cp.Addr()+"/sluice.admin.v1.AdminTokenService/WhoAmI", strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+strings.Repeat("b", 40))
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), `"principal":"bootstrap"`)
	// Metrics count the call and show the publisher.
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + cp.Addr() + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		m, _ := io.ReadAll(resp.Body)
		return strings.Contains(string(m), `sluice_control_admin_requests_total{code="ok",method="WhoAmI",service="AdminTokenService"} 1`) &&
			strings.Contains(string(m), "sluice_control_publisher_leader 1") &&
			strings.Contains(string(m), "sluice_control_snapshots_compiled_total 1")
	}, 10*time.Second, 50*time.Millisecond)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

func TestMigrationsRoundTrip(t *testing.T) {
	t.Parallel()
	url := emptyDatabase(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	applied, err := migrations.Apply(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, migrations.Latest(), applied[len(applied)-1])
	again, err := migrations.Apply(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, again, "a second run applies nothing")
	require.NoError(t, migrations.CheckCurrent(ctx, pool))
}

func TestConfigValidateReportsEverything(t *testing.T) {
	t.Parallel()
	c := Config{DatabaseURL: "", AdminAddr: "nonsense", BootstrapToken: "short", KeyPepper: "1:short", KEK: "1:dG9vLXNob3J0", ShutdownTimeout: -1}
	err := c.Validate()
	require.Error(t, err)
	for _, want := range []string{"database URL is required", "admin address", "NATS URL is required", "bootstrap admin token", "key pepper", "key ring (SLUICE_KEK): key ring version 1: want 32 bytes", "shutdown timeout"} {
		require.Contains(t, err.Error(), want)
	}
	c.KEK = ""
	require.ErrorContains(t, c.Validate(), "key ring is required (SLUICE_KEK or SLUICE_KEK_FILE)")
}
