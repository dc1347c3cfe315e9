package admin

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// spendWorld is two orgs' recorded spend: org A's team one and team two
// (each with a key), and org B, all using model group "qwen".
type spendWorld struct {
	a            orgFixture
	orgB         string
	logs         []store.SpendLog
	platform     string
	orgA, orgBTk string
	team1        string
}

func (b *bundle) spendClient(tok string) adminv1connect.SpendServiceClient {
	return adminv1connect.NewSpendServiceClient(http.DefaultClient, b.url, connect.WithInterceptors(bearer(tok)))
}

func (b *bundle) mkSpendWorld() spendWorld {
	b.t.Helper()
	w := spendWorld{a: b.mkFixture("spend"), platform: b.bootstrap}
	w.orgB = b.mkOrg("spend-b-" + u()).Id
	t1, t2 := w.a.team1, w.a.team2
	// The bundle's clock is 2026-11-01 12:00 UTC.
	at := func(d string) time.Time {
		tm, err := time.Parse(time.RFC3339, d)
		require.NoError(b.t, err)
		return tm
	}
	mk := func(i int, when, org, team, key string, cost float64) store.SpendLog {
		return store.SpendLog{RequestID: fmt.Sprintf("req_%03d", i), At: at(when), OrgID: org, TeamID: team, KeyID: key,
			ModelGroup: "qwen", Tags: []string{"agents"}, PromptTokens: 100, CompletionTokens: 10, CachedTokens: 5,
			CostUSD: cost, Status: 200}
	}
	w.logs = []store.SpendLog{
		mk(1, "2026-10-30T08:00:00Z", t1.OrgID, t1.TeamID, t1.KeyID, 1),
		mk(2, "2026-10-30T09:00:00Z", t1.OrgID, t1.TeamID, t1.KeyID, 2),
		mk(3, "2026-11-01T10:00:00Z", t1.OrgID, t1.TeamID, t1.KeyID, 4),
		mk(4, "2026-10-31T10:00:00Z", t2.OrgID, t2.TeamID, t2.KeyID, 8),
		mk(5, "2026-10-31T11:00:00Z", w.orgB, "", "", 16),
		mk(6, "2026-10-31T12:00:00Z", t1.OrgID, t1.TeamID, t1.KeyID, 32),
		mk(7, "2026-10-31T12:00:00Z", t1.OrgID, t1.TeamID, t1.KeyID, 64),
	}
	_, err := b.store.SpendRecord(context.Background(), w.logs)
	require.NoError(b.t, err)
	w.orgA = b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, t1.OrgID, "")
	w.orgBTk = b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, w.orgB, "")
	w.team1 = b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, t1.OrgID, t1.TeamID)
	return w
}

func getSpend(b *bundle, tok string, scope adminv1.SpendScope, id, org string) (float64, string) {
	b.t.Helper()
	r, err := b.spendClient(tok).GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{Scope: scope, Id: id, OrgId: org}))
	if err != nil {
		return 0, codeOf(err)
	}
	return r.Msg.SpendUsd, "ok"
}

func TestGetSpendSumsWithinTheCallersTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := b.mkSpendWorld()
	t1, t2 := w.a.team1, w.a.team2
	type row struct {
		who, tok string
		scope    adminv1.SpendScope
		id, org  string
		code     string
		usd      float64
	}
	const (
		org   = adminv1.SpendScope_SPEND_SCOPE_ORG
		team  = adminv1.SpendScope_SPEND_SCOPE_TEAM
		key   = adminv1.SpendScope_SPEND_SCOPE_KEY
		user  = adminv1.SpendScope_SPEND_SCOPE_USER
		group = adminv1.SpendScope_SPEND_SCOPE_MODEL_GROUP
		tag   = adminv1.SpendScope_SPEND_SCOPE_TAG
	)
	for _, r := range []row{
		{"platform", w.platform, org, t1.OrgID, "", "ok", 1 + 2 + 4 + 8 + 32 + 64},
		{"platform", w.platform, org, w.orgB, "", "ok", 16},
		{"platform", w.platform, group, "qwen", "", "ok", 127},
		{"platform", w.platform, group, "qwen", w.orgB, "ok", 16},
		{"platform", w.platform, tag, "agents", t1.OrgID, "ok", 111},
		{"platform", w.platform, team, t2.TeamID, "", "ok", 8},
		{"org A", w.orgA, org, t1.OrgID, "", "ok", 111},
		{"org A", w.orgA, group, "qwen", "", "ok", 111},
		{"org A", w.orgA, key, t1.KeyID, "", "ok", 103},
		{"org A", w.orgA, team, t2.TeamID, "", "ok", 8},
		{"org A", w.orgA, org, w.orgB, "", "permission_denied", 0},
		{"org A", w.orgA, group, "qwen", w.orgB, "permission_denied", 0},
		{"org B", w.orgBTk, team, t1.TeamID, "", "ok", 0}, // only org B's rows: none
		{"org B", w.orgBTk, key, t1.KeyID, "", "ok", 0},
		{"team 1", w.team1, team, t1.TeamID, "", "ok", 103},
		{"team 1", w.team1, key, t1.KeyID, "", "ok", 103},
		{"team 1", w.team1, team, t2.TeamID, "", "permission_denied", 0},
		{"team 1", w.team1, key, t2.KeyID, "", "permission_denied", 0},
		{"team 1", w.team1, key, "key_unknown", "", "permission_denied", 0},
		{"team 1", w.team1, org, t1.OrgID, "", "permission_denied", 0},
		{"team 1", w.team1, user, t1.UserID, "", "permission_denied", 0},
		{"team 1", w.team1, group, "qwen", "", "permission_denied", 0},
		{"team 1", w.team1, tag, "agents", "", "permission_denied", 0},
	} {
		usd, code := getSpend(b, r.tok, r.scope, r.id, r.org)
		require.Equal(t, r.code, code, "%s: %s %s (org %q)", r.who, r.scope, r.id, r.org)
		require.InDelta(t, r.usd, usd, 1e-9, "%s: %s %s (org %q)", r.who, r.scope, r.id, r.org)
	}

	// Whole UTC days: a window starting at any time on 2026-11-01 holds
	// that day only; totals carry every counter.
	resp, err := b.spendClient(w.platform).GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{
		Scope: key, Id: t1.KeyID, StartTime: timestamppb.New(time.Date(2026, 11, 1, 18, 0, 0, 0, time.UTC)),
	}))
	require.NoError(t, err)
	require.InDelta(t, 4.0, resp.Msg.SpendUsd, 1e-9)
	require.Equal(t, int64(1), resp.Msg.Requests)
	require.Equal(t, int64(100), resp.Msg.PromptTokens)
	require.Equal(t, int64(10), resp.Msg.CompletionTokens)
	require.Equal(t, int64(5), resp.Msg.CachedTokens)
	// An end inside 2026-10-31 rounds up to include that day.
	resp, err = b.spendClient(w.platform).GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{
		Scope: key, Id: t1.KeyID, StartTime: timestamppb.New(time.Date(2026, 10, 31, 0, 0, 0, 0, time.UTC)),
		EndTime: timestamppb.New(time.Date(2026, 10, 31, 0, 0, 1, 0, time.UTC)),
	}))
	require.NoError(t, err)
	require.InDelta(t, 96.0, resp.Msg.SpendUsd, 1e-9)
	require.Equal(t, int64(2), resp.Msg.Requests)
}

func TestGetSpendValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.spendClient(b.bootstrap)
	jan := func(d int) *timestamppb.Timestamp {
		return timestamppb.New(time.Date(2026, 1, d, 0, 0, 0, 0, time.UTC))
	}
	for _, r := range []struct {
		req  *adminv1.GetSpendRequest
		want string
	}{
		{&adminv1.GetSpendRequest{Id: "x"}, "scope: required"},
		{&adminv1.GetSpendRequest{Scope: 99, Id: "x"}, "scope: required"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TEAM}, "id: required"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TEAM, Id: "t", StartTime: jan(5), EndTime: jan(5)}, "end_time: must be after start_time"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TEAM, Id: "t", StartTime: jan(9), EndTime: jan(5)}, "end_time: must be after start_time"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TEAM, Id: "t", StartTime: timestamppb.New(time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)), EndTime: jan(5)}, "at most 400"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_ORG, Id: "org_a", OrgId: "org_b"}, "org_id: must be empty or equal to id"},
		{&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TEAM, Id: "t", StartTime: &timestamppb.Timestamp{Seconds: -1e15}}, "start_time: invalid timestamp"},
	} {
		_, err := c.GetSpend(context.Background(), connect.NewRequest(r.req))
		require.Equal(t, "invalid_argument", codeOf(err), "%v", r.req)
		require.Contains(t, err.Error(), r.want)
	}
	// A window of exactly 400 days is fine.
	_, err := c.GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{Scope: adminv1.SpendScope_SPEND_SCOPE_TAG, Id: "x",
		StartTime: jan(1), EndTime: timestamppb.New(jan(1).AsTime().Add(400 * 24 * time.Hour))}))
	require.NoError(t, err)
}

func TestListSpendLogsNewestFirstPagedWithinTheTenant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	w := b.mkSpendWorld()
	t1 := w.a.team1
	list := func(tok string, req *adminv1.ListSpendLogsRequest) ([]string, string) {
		t.Helper()
		var ids []string
		for {
			r, err := b.spendClient(tok).ListSpendLogs(context.Background(), connect.NewRequest(req))
			if err != nil {
				return ids, codeOf(err)
			}
			for _, l := range r.Msg.Logs {
				ids = append(ids, l.RequestId)
			}
			if r.Msg.NextPageToken == "" {
				return ids, "ok"
			}
			req.PageToken = r.Msg.NextPageToken
		}
	}
	// req_006 and req_007 share a timestamp: request id breaks the tie.
	ids, code := list(w.platform, &adminv1.ListSpendLogsRequest{PageSize: 2})
	require.Equal(t, "ok", code)
	require.Equal(t, []string{"req_003", "req_007", "req_006", "req_005", "req_004", "req_002", "req_001"}, ids)

	ids, code = list(w.orgA, &adminv1.ListSpendLogsRequest{PageSize: 3})
	require.Equal(t, "ok", code)
	require.Equal(t, []string{"req_003", "req_007", "req_006", "req_004", "req_002", "req_001"}, ids, "org A sees its own org only")

	ids, code = list(w.team1, &adminv1.ListSpendLogsRequest{PageSize: 1})
	require.Equal(t, "ok", code)
	require.Equal(t, []string{"req_003", "req_007", "req_006", "req_002", "req_001"}, ids, "team one sees its own team only")

	ids, code = list(w.orgA, &adminv1.ListSpendLogsRequest{KeyId: w.a.team2.KeyID})
	require.Equal(t, "ok", code)
	require.Equal(t, []string{"req_004"}, ids)

	ids, code = list(w.platform, &adminv1.ListSpendLogsRequest{ModelGroup: "qwen",
		StartTime: timestamppb.New(time.Date(2026, 10, 31, 0, 0, 0, 0, time.UTC)),
		EndTime:   timestamppb.New(time.Date(2026, 10, 31, 12, 0, 0, 0, time.UTC))})
	require.Equal(t, "ok", code)
	require.Equal(t, []string{"req_005", "req_004"}, ids, "end is exclusive")

	_, code = list(w.orgA, &adminv1.ListSpendLogsRequest{OrgId: w.orgB})
	require.Equal(t, "permission_denied", code)
	_, code = list(w.team1, &adminv1.ListSpendLogsRequest{TeamId: w.a.team2.TeamID})
	require.Equal(t, "permission_denied", code)
	ids, code = list(w.orgBTk, &adminv1.ListSpendLogsRequest{TeamId: t1.TeamID})
	require.Equal(t, "ok", code)
	require.Empty(t, ids, "another org's team: nothing")

	_, code = list(w.platform, &adminv1.ListSpendLogsRequest{PageToken: "bm90LWEtY3Vyc29y"})
	require.Equal(t, "invalid_argument", code)
	_, code = list(w.platform, &adminv1.ListSpendLogsRequest{StartTime: timestamppb.New(time.Date(2026, 10, 31, 0, 0, 0, 0, time.UTC)),
		EndTime: timestamppb.New(time.Date(2026, 10, 30, 0, 0, 0, 0, time.UTC))})
	require.Equal(t, "invalid_argument", code)
}
