package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestLocalRateFallbackSharesTheLimit: with --rate-limit-fallback=local and
// Redis unreachable, each data plane admits an rpm-only key up to its share
// of the limit (limit ÷ live data planes of the region, counted from their
// heartbeats), while keys with a budget or a concurrency limit fail closed.
func TestLocalRateFallbackSharesTheLimit(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 1e-6}}))
	require.NoError(t, err)
	rpm, par := d.NewTenant("rpm"), d.NewTenant("par")
	c := d.Clients()
	limit, one := int64(6), int64(1)
	for _, u := range []struct {
		id string
		l  *adminv1.Limits
	}{{rpm.KeyID, &adminv1.Limits{RpmLimit: &limit}}, {par.KeyID, &adminv1.Limits{MaxParallelRequests: &one}}} {
		_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: u.id, Limits: u.l},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
		require.NoError(t, err)
	}
	dead := "redis://" + closedPort(t) + "/0"
	opt := func(c *dataplane.Config) { c.RedisURL, c.RateLimitFallback = dead, dataplane.RateFallbackLocal }
	ps := []*proxy{d.StartProxy("default", time.Minute, opt), d.StartProxy("default", time.Minute, opt), d.StartProxy("default", time.Minute, opt)}
	peppers := testPeppers(t)
	for _, p := range ps {
		harness.Eventually(t, func() bool {
			pr, err := p.DP.Catalog().Authenticate(peppers, rpm.Token, time.Now())
			pq, err2 := p.DP.Catalog().Authenticate(peppers, par.Token, time.Now())
			return err == nil && err2 == nil && pr.Key.GetLimits().GetRpmLimit() == limit && pq.Key.GetLimits().GetMaxParallelRequests() == 1 &&
				len(p.DP.Catalog().Deployments("m")) == 1
		}, 10*time.Second, 10*time.Millisecond)
	}
	// Every plane hears the other two (heartbeats every 200 ms).
	time.Sleep(700 * time.Millisecond)
	for i, p := range ps {
		admitted := 0
		for range 5 {
			e := settingsPost(t, p, rpm.Token, "", settingsBody)
			switch e.status {
			case http.StatusOK:
				admitted++
			case http.StatusTooManyRequests:
				require.Equal(t, "rpm", e.hdr.Get(dataplane.HeaderLimitType))
			default:
				t.Fatalf("proxy %d answered %d %s", i, e.status, e.Error.Code)
			}
		}
		require.Equal(t, int(limit)/len(ps), admitted, "proxy %d admits its share: %d ÷ %d planes", i, limit, len(ps))
		e := settingsPost(t, p, par.Token, "", settingsBody)
		require.Equal(t, http.StatusServiceUnavailable, e.status, "concurrency never falls back")
		require.Equal(t, dataplane.CodeLimitsUnavailable, e.Error.Code)
	}
}

// TestSoleDataPlaneSkipsStartupQuarantine: on a Redis without state, a
// fleet's data planes quarantine concurrency-limited scopes of orgs and
// deployments created long before (503 limits_recovering) until live
// requests could re-assert their leases; a data plane declared the only one
// (sluice dev) bootstraps every epoch of its first snapshot and serves at
// once. And any data plane bootstraps the epochs of the orgs and
// deployments of its first snapshot created within
// configsync.FirstSnapshotNewAge, and serves their first request at once.
func TestSoleDataPlaneSkipsStartupQuarantine(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, MaxConcurrency: 4, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 1e-6}}))
	require.NoError(t, err)
	ten := d.NewTenant("sole")
	par := int64(2)
	_, err = d.Clients().Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: ten.KeyID,
		Limits: &adminv1.Limits{MaxParallelRequests: &par}}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
	require.NoError(t, err)
	// The data plane's first snapshot must hold the org, key and deployment
	// (a data plane that learns them from events bootstraps them anyway).
	d.freshSnapshot(t)
	run := func(sole bool, wantOK bool) {
		harness.CleanRedisPrefix(t, d.RedisURL, d.RedisPrefix) // Redis without state
		p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.SoleDataPlane = sole })
		defer p.Cancel()
		harness.Eventually(t, func() bool {
			pr, err := p.DP.Catalog().Authenticate(testPeppers(t), ten.Token, time.Now())
			return err == nil && pr.Key.GetLimits().GetMaxParallelRequests() == par && len(p.DP.Catalog().Deployments("m")) == 1
		}, 10*time.Second, 10*time.Millisecond)
		e := settingsPost(t, p, ten.Token, "", settingsBody)
		if wantOK {
			// The epochs were bootstrapped before the data plane was ready.
			require.Equal(t, http.StatusOK, e.status, "sole=%v: %s %s", sole, e.Error.Code, e.Error.Message)
		} else {
			require.Equal(t, http.StatusServiceUnavailable, e.status)
			require.Equal(t, dataplane.CodeLimitsRecovering, e.Error.Code)
		}
	}
	run(false, true) // created just now: bootstrapped by any data plane
	// Created long before: a missing epoch may be lost state.
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		for _, table := range []string{"orgs", "deployments"} {
			_, err := conn.Exec(ctx, `UPDATE `+table+` SET created_at = created_at - interval '1 hour'`)
			require.NoError(t, err)
		}
	})
	d.freshSnapshot(t)
	run(false, false)
	run(true, true)
}
