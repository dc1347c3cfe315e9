package admin

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

func (b *bundle) alertClient(tok string) adminv1connect.AlertServiceClient {
	return adminv1connect.NewAlertServiceClient(http.DefaultClient, b.url, connect.WithInterceptors(bearer(tok)))
}

// listAlerts pages through ListAlerts and returns the alert ids, or the
// Connect code of the first failure.
func (b *bundle) listAlerts(tok string, req *adminv1.ListAlertsRequest) ([]string, string) {
	b.t.Helper()
	var ids []string
	for {
		r, err := b.alertClient(tok).ListAlerts(context.Background(), connect.NewRequest(req))
		if err != nil {
			return ids, codeOf(err)
		}
		for _, a := range r.Msg.Alerts {
			ids = append(ids, a.AlertId)
		}
		if r.Msg.NextPageToken == "" {
			return ids, "ok"
		}
		req.PageToken = r.Msg.NextPageToken
	}
}

func TestListAlertsNewestFirstPagedWithinTheTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.mkFixture("alerts")
	// Only this test's alerts (the fixture records one for its dead
	// delivery).
	_, err := b.pool.Exec(context.Background(), `DELETE FROM budget_alerts`)
	require.NoError(t, err)
	t1, t2 := a.team1, a.team2
	orgB := b.mkOrg("alerts-b-" + u()).Id
	nov1 := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	at := func(min int) time.Time { return time.Date(2026, 11, 17, 10, min, 0, 0, time.UTC) }
	mk := func(id string, fired time.Time, org, team, kind, scope string, pct int32) store.BudgetAlert {
		return store.BudgetAlert{AlertID: id, FiredAt: fired, OrgID: org, TeamID: team, ScopeKind: kind, ScopeID: scope,
			ThresholdPercent: pct, SpendMicros: 5_250_000, CapMicros: 10_000_000, SoftMicros: 2_000_000, Window: "1mo",
			WindowStart: nov1, Region: "eu", InstanceID: "dp-1", RequestID: "req_" + id}
	}
	_, err = b.store.AlertRecord(context.Background(), []store.BudgetAlert{
		mk("a1", at(0), t1.OrgID, t1.TeamID, "key", t1.KeyID, 50),
		mk("a2", at(1), t1.OrgID, t1.TeamID, "key", t1.KeyID, 85),
		mk("a3", at(2), t2.OrgID, t2.TeamID, "team", t2.TeamID, 0),
		mk("a4", at(3), t1.OrgID, "", "org", t1.OrgID, 100),
		mk("a6", at(3), t1.OrgID, t1.TeamID, "member", t1.TeamID+"/"+t1.UserID, 95),
		mk("a5", at(4), orgB, "", "org", orgB, 50),
	})
	require.NoError(t, err)
	platform := b.bootstrap
	orgA := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, t1.OrgID, "")
	orgBTk := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, orgB, "")
	team1 := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, t1.OrgID, t1.TeamID)

	for _, r := range []struct {
		who, tok string
		req      *adminv1.ListAlertsRequest
		code     string
		ids      []string
	}{
		// a4 and a6 fired at the same time: the alert id breaks the tie.
		{"platform, pages of 2", platform, &adminv1.ListAlertsRequest{PageSize: 2}, "ok", []string{"a5", "a6", "a4", "a3", "a2", "a1"}},
		{"platform, org B", platform, &adminv1.ListAlertsRequest{OrgId: orgB}, "ok", []string{"a5"}},
		{"platform, team 2", platform, &adminv1.ListAlertsRequest{TeamId: t2.TeamID}, "ok", []string{"a3"}},
		{"org A, pages of 1", orgA, &adminv1.ListAlertsRequest{PageSize: 1}, "ok", []string{"a6", "a4", "a3", "a2", "a1"}},
		{"org A, its own org named", orgA, &adminv1.ListAlertsRequest{OrgId: t1.OrgID, PageSize: 3}, "ok", []string{"a6", "a4", "a3", "a2", "a1"}},
		{"org A, key scope", orgA, &adminv1.ListAlertsRequest{ScopeKind: "key", ScopeId: t1.KeyID}, "ok", []string{"a2", "a1"}},
		{"org A, since", orgA, &adminv1.ListAlertsRequest{Since: timestamppb.New(at(2))}, "ok", []string{"a6", "a4", "a3"}},
		{"org A asks for org B", orgA, &adminv1.ListAlertsRequest{OrgId: orgB}, "permission_denied", nil},
		{"org B asks for a team of org A", orgBTk, &adminv1.ListAlertsRequest{TeamId: t1.TeamID}, "ok", nil},
		{"org B", orgBTk, &adminv1.ListAlertsRequest{}, "ok", []string{"a5"}},
		{"team 1: its team's alerts only", team1, &adminv1.ListAlertsRequest{PageSize: 2}, "ok", []string{"a6", "a2", "a1"}},
		{"team 1 asks for team 2", team1, &adminv1.ListAlertsRequest{TeamId: t2.TeamID}, "permission_denied", nil},
		{"team 1 asks for org B", team1, &adminv1.ListAlertsRequest{OrgId: orgB}, "permission_denied", nil},
	} {
		ids, code := b.listAlerts(r.tok, r.req)
		require.Equal(t, r.code, code, r.who)
		require.Equal(t, r.ids, ids, r.who)
	}

	// Every field, amounts in USD.
	resp, err := b.alertClient(orgA).ListAlerts(context.Background(), connect.NewRequest(&adminv1.ListAlertsRequest{ScopeKind: "member"}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.Alerts, 1)
	require.True(t, proto.Equal(&adminv1.Alert{
		AlertId: "a6", Time: timestamppb.New(at(3)), OrgId: t1.OrgID, TeamId: t1.TeamID, ScopeKind: "member",
		ScopeId: t1.TeamID + "/" + t1.UserID, ThresholdPercent: 95, SpendUsd: 5.25, CapUsd: 10, SoftBudgetUsd: 2,
		BudgetDuration: "1mo", WindowStart: timestamppb.New(nov1), Region: "eu", RequestId: "req_a6",
	}, resp.Msg.Alerts[0]), "%v", resp.Msg.Alerts[0])
}

func TestListAlertsValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.alertClient(b.bootstrap)
	for _, r := range []struct {
		req  *adminv1.ListAlertsRequest
		want string
	}{
		{&adminv1.ListAlertsRequest{ScopeKind: "deployment"}, "scope_kind: must be one of key, user, member, team, org, customer, project, tag, key_model, team_model"},
		{&adminv1.ListAlertsRequest{ScopeId: strings.Repeat("x", 201)}, "scope_id: must be at most 200 bytes"},
		// NUL is refused for every RPC before the handler (checkText).
		{&adminv1.ListAlertsRequest{OrgId: "org_\x00"}, "org_id: must not contain NUL"},
		{&adminv1.ListAlertsRequest{Since: &timestamppb.Timestamp{Seconds: -1e15}}, "since: invalid timestamp"},
		{&adminv1.ListAlertsRequest{PageToken: "bm90LWEtY3Vyc29y"}, "page_token: not a token from a previous page"},
		{&adminv1.ListAlertsRequest{PageSize: -1}, "page_size: must not be negative"},
	} {
		_, err := c.ListAlerts(context.Background(), connect.NewRequest(r.req))
		require.Equal(t, "invalid_argument", codeOf(err), "%v", r.req)
		require.Contains(t, err.Error(), r.want)
	}
}

// TestRotateAlertWebhookSecret: a rotation returns a new secret once and,
// with a grace period, shows until when the previous secret keeps
// signing; the audit record carries the grace; a bad grace period changes
// nothing; another org's admin cannot rotate the webhook.
func TestRotateAlertWebhookSecret(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("rot-" + u())
	other := b.mkOrg("rot-other-" + u())
	admin := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, org.Id, "")
	c := b.alertClient(admin)
	cr, err := c.CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: "https://hooks.example.com/rot"}))
	require.NoError(t, err)
	id := cr.Msg.Webhook.Id

	r, err := c.RotateAlertWebhookSecret(ctx, connect.NewRequest(&adminv1.RotateAlertWebhookSecretRequest{Id: id, GracePeriod: "24h"}))
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(r.Msg.Secret, "whsec_"))
	require.NotEqual(t, cr.Msg.Secret, r.Msg.Secret)
	until := r.Msg.Webhook.GetPreviousSecretValidUntil().AsTime()
	require.NotNil(t, r.Msg.Webhook.GetSecretRotateTime())
	require.Equal(t, 24*time.Hour, until.Sub(r.Msg.Webhook.GetSecretRotateTime().AsTime()), "the grace runs from the rotation")
	a := b.lastAudit()
	require.Equal(t, []string{"rotated", "alert_webhook", id, org.Id}, []string{a.Action, a.ObjectType, a.ObjectID, a.OrgID})
	require.Contains(t, a.After, `"grace_period":"24h0m0s"`)
	require.NotContains(t, a.After, "whsec_", "the audit record holds no secret")

	l, err := c.ListAlertWebhooks(ctx, connect.NewRequest(&adminv1.ListAlertWebhooksRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.Webhooks, 1)
	require.Equal(t, until, l.Msg.Webhooks[0].GetPreviousSecretValidUntil().AsTime())

	// Without grace: no previous secret signs any more.
	r, err = c.RotateAlertWebhookSecret(ctx, connect.NewRequest(&adminv1.RotateAlertWebhookSecretRequest{Id: id}))
	require.NoError(t, err)
	require.Nil(t, r.Msg.Webhook.GetPreviousSecretValidUntil())

	otherAdmin := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, other.Id, "")
	before := b.auditCount()
	for _, g := range []string{"forever", "-1h", "31d"} {
		_, err = c.RotateAlertWebhookSecret(ctx, connect.NewRequest(&adminv1.RotateAlertWebhookSecretRequest{Id: id, GracePeriod: g}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%s: %v", g, err)
		require.Contains(t, err.Error(), "grace_period")
	}
	_, err = b.alertClient(otherAdmin).RotateAlertWebhookSecret(ctx, connect.NewRequest(&adminv1.RotateAlertWebhookSecretRequest{Id: id}))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "%v", err)
	require.Equal(t, before, b.auditCount(), "refused rotations are not audited")
}
