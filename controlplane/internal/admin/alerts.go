package admin

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/budget"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// alertService implements AlertService: reads of the budget alerts the
// data planes raised (controlplane/internal/alerts records them).
//
// Tenant isolation, as for spend logs: platform tokens read every alert
// (optionally one org's); org tokens only their org's; team tokens only
// alerts whose team is theirs. Asking for another org (or, with a team
// token, another team) is PermissionDenied.
type alertService struct{ *Server }

// alertScopeKinds are the scope kinds budgets (and so alerts) have.
var alertScopeKinds = []string{budget.KindKey, budget.KindUser, budget.KindMember, budget.KindTeam, budget.KindOrg,
	budget.KindCustomer, budget.KindProject, budget.KindTag, budget.KindKeyModel, budget.KindTeamModel}

func alertToProto(a store.BudgetAlert) *adminv1.Alert {
	return &adminv1.Alert{
		AlertId: a.AlertID, Time: timestamppb.New(a.FiredAt), OrgId: a.OrgID, TeamId: a.TeamID, ScopeKind: a.ScopeKind,
		ScopeId: a.ScopeID, ThresholdPercent: a.ThresholdPercent, SpendUsd: usd(a.SpendMicros), CapUsd: usd(a.CapMicros),
		SoftBudgetUsd: usd(a.SoftMicros), BudgetDuration: a.Window, WindowStart: timestamppb.New(a.WindowStart),
		Region: a.Region, RequestId: a.RequestID,
	}
}

// usd converts micro-USD to USD.
func usd(micros int64) float64 { return float64(micros) / 1e6 }

// alertCursor is the keyset page token of ListAlerts, in the format of
// spendCursor: "<unix microseconds>|<alert id>" of the page's last alert.
func alertCursor(a store.BudgetAlert) string {
	return strconv.FormatInt(a.FiredAt.UnixMicro(), 10) + "|" + a.AlertID
}

func (s *alertService) ListAlerts(ctx context.Context, req *connect.Request[adminv1.ListAlertsRequest]) (*connect.Response[adminv1.ListAlertsResponse], error) {
	p := principal(ctx)
	m := req.Msg
	t := tenant(ctx)
	target := tokenTarget(p.Scope, p.OrgID, p.TeamID, "budget alerts")
	switch {
	case m.GetOrgId() != "" && t.OrgID != "" && m.GetOrgId() != t.OrgID:
		target = authz.OrgTarget(m.GetOrgId(), "budget alerts of org "+m.GetOrgId())
	case m.GetTeamId() != "" && t.TeamID != "" && m.GetTeamId() != t.TeamID:
		target = authz.TeamTarget(p.OrgID, m.GetTeamId(), "budget alerts of team "+m.GetTeamId())
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	q := store.AlertQuery{Tenant: t, ScopeKind: m.GetScopeKind(), ScopeID: m.GetScopeId()}
	if q.OrgID == "" {
		q.OrgID = m.GetOrgId()
	}
	if q.TeamID == "" {
		q.TeamID = m.GetTeamId()
	}
	c := &validator{}
	if k := m.GetScopeKind(); k != "" && !slices.Contains(alertScopeKinds, k) {
		c.add("scope_kind", "must be one of %s (got %q)", strings.Join(alertScopeKinds, ", "), k)
	}
	for _, f := range []struct{ name, v string }{{"org_id", m.GetOrgId()}, {"team_id", m.GetTeamId()}, {"scope_id", m.GetScopeId()}} {
		if len(f.v) > maxSpendIDLen || !utf8.ValidString(f.v) || strings.IndexByte(f.v, 0) >= 0 {
			c.add(f.name, "must be at most %d bytes of UTF-8 without NUL", maxSpendIDLen)
		}
	}
	q.Since = checkTime(c, "since", m.Since)
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	q.AfterAt, q.AfterID = timeCursor(c, after)
	if err := c.err(); err != nil {
		return nil, err
	}
	rows, err := s.store.AlertList(ctx, q, limit)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListAlertsResponse{}
	resp.Alerts, resp.NextPageToken, err = page(rows, limit, infallible(alertToProto), alertCursor)
	return reply(resp, err)
}
