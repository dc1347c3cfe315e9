package system

import (
	"context"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/token"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// TestBudgetAlertsAndSeedsEndToEnd drives budgets through every plane: a
// key's spend crosses its soft budget and the 50/85/95/100 % thresholds
// (each alert reaches AlertService.ListAlerts exactly once, from the data
// plane over NATS into Postgres; the 50 % one raised by a quota slice's
// carve that no request takes from), the cap rejects, and after Redis loses
// every limits key the budget is re-seeded from the ledger's spend (the
// control plane answers the data plane's seed request) rather than reset
// to zero.
func TestBudgetAlertsAndSeedsEndToEnd(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t) // 10 prompt + 5 completion tokens
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	// $10 a request.
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: &adminv1.Prices{InputPerToken: 0.5, OutputPerToken: 1}}))
	require.NoError(t, err)
	ten := d.NewTenant("alerts")
	c := d.Clients()
	soft, hard := 1.0, 25.0
	_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: ten.KeyID, Limits: &adminv1.Limits{MaxBudget: &hard, SoftBudget: &soft, BudgetDuration: "1d"}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
	require.NoError(t, err)
	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool {
		pr, err := p.DP.Catalog().Authenticate(testPeppers(t), ten.Token, time.Now())
		return err == nil && pr.Key.GetLimits().GetMaxBudget() == hard && len(p.DP.Catalog().Deployments("m")) == 1
	}, 10*time.Second, 10*time.Millisecond)

	ac := adminv1connect.NewAlertServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	// Spend 0 → 10 → 20 → 30: three admitted (each saw spend < $25).
	for i := range 3 {
		e := settingsPost(t, p, ten.Token, "", settingsBody)
		require.Equal(t, http.StatusOK, e.status, "request %d", i)
		if i == 0 {
			// $10 spent (40 %). The data plane's slice worker then carves
			// a budget slice for the scope ($25 less the 10 % reserve and
			// the spend, a quarter of it: $3.125), which takes the spend
			// past 50 %. No request takes from that slice ($10 each), so
			// the 50 % alert must come from the carve itself, at once and
			// with no request id.
			harness.Eventually(t, func() bool {
				r, err := ac.ListAlerts(ctx, connect.NewRequest(&adminv1.ListAlertsRequest{OrgId: ten.OrgID}))
				require.NoError(t, err)
				for _, a := range r.Msg.Alerts {
					if a.ThresholdPercent == 50 {
						require.Empty(t, a.RequestId, "the 50 percent alert comes from the carve")
						return true
					}
				}
				return false
			}, 15*time.Second, 50*time.Millisecond, "the carve's 50 percent alert was not listed")
		}
		require.NoError(t, p.DP.Drain(ctx))
	}
	e := settingsPost(t, p, ten.Token, "", settingsBody)
	require.Equal(t, http.StatusTooManyRequests, e.status)
	require.Equal(t, dataplane.CodeBudgetExceeded, e.Error.Code)
	require.Contains(t, e.Error.Message, "spend $30.000000")

	// Alerts: soft ($1, crossed at $10), 50 % ($12.5, by the carve above),
	// 85/95/100 % (at $30) — each exactly once.
	var got []int32
	harness.Eventually(t, func() bool {
		r, err := ac.ListAlerts(ctx, connect.NewRequest(&adminv1.ListAlertsRequest{OrgId: ten.OrgID}))
		require.NoError(t, err)
		got = got[:0]
		for _, a := range r.Msg.Alerts {
			require.Equal(t, "key", a.ScopeKind)
			require.Equal(t, ten.KeyID, a.ScopeId)
			require.Equal(t, ten.TeamID, a.TeamId)
			got = append(got, a.ThresholdPercent)
		}
		slices.Sort(got)
		return len(got) >= 5
	}, 15*time.Second, 50*time.Millisecond, "alerts listed: %v", got)
	require.Equal(t, []int32{0, 50, 85, 95, 100}, got)

	// The ledger holds the three requests ($30).
	harness.Eventually(t, func() bool { return d.spendRowCount(t) == 4 }, 15*time.Second, 50*time.Millisecond) // 3 + the 429

	// Redis loses every limits key. The next request's admission finds the
	// key's budget window missing and seeds it from the ledger ($30).
	harness.CleanRedisPrefix(t, d.RedisURL, d.RedisPrefix)
	e = settingsPost(t, p, ten.Token, "", settingsBody)
	require.Equal(t, http.StatusTooManyRequests, e.status, "re-seeded from Postgres, not reset to zero")
	require.Equal(t, dataplane.CodeBudgetExceeded, e.Error.Code)
	require.Contains(t, e.Error.Message, "spend $30.000000")
}

func testPeppers(t testing.TB) *token.Peppers {
	t.Helper()
	p, err := token.ParsePeppers(testPepper)
	require.NoError(t, err)
	return p
}
