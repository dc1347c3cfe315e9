package admin

import (
	"context"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// spendService implements SpendService: reads of the usage ledger.
//
// Tenant isolation: platform tokens read everything (optionally one org);
// org tokens read only their org's spend; team tokens read only the spend
// of their own team (scope TEAM) and of the keys of their team (scope KEY)
// and only their team's logs. Everything else is PermissionDenied.
type spendService struct{ *Server }

const (
	// defaultSpendWindow is GetSpend's window when start_time is unset.
	defaultSpendWindow = 30 * 24 * time.Hour
	// maxSpendWindow bounds GetSpend's window (a little over a year, so
	// "this year" always fits).
	maxSpendWindow = 400 * 24 * time.Hour
	maxSpendIDLen  = 200
	day            = 24 * time.Hour
)

var spendScopeNames = map[adminv1.SpendScope]string{
	adminv1.SpendScope_SPEND_SCOPE_ORG:         store.SpendScopeOrg,
	adminv1.SpendScope_SPEND_SCOPE_TEAM:        store.SpendScopeTeam,
	adminv1.SpendScope_SPEND_SCOPE_USER:        store.SpendScopeUser,
	adminv1.SpendScope_SPEND_SCOPE_KEY:         store.SpendScopeKey,
	adminv1.SpendScope_SPEND_SCOPE_CUSTOMER:    store.SpendScopeCustomer,
	adminv1.SpendScope_SPEND_SCOPE_MODEL_GROUP: store.SpendScopeModelGroup,
	adminv1.SpendScope_SPEND_SCOPE_DEPLOYMENT:  store.SpendScopeDeployment,
	adminv1.SpendScope_SPEND_SCOPE_TAG:         store.SpendScopeTag,
}

// floorDay and ceilDay round t to UTC midnights.
func floorDay(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
}

func ceilDay(t time.Time) time.Time {
	f := floorDay(t)
	if f.Equal(t) {
		return f
	}
	return f.Add(day)
}

// checkTime validates an optional timestamp field.
func checkTime(c *validator, field string, ts *timestamppb.Timestamp) *time.Time {
	if ts == nil {
		return nil
	}
	if err := ts.CheckValid(); err != nil {
		c.add(field, "invalid timestamp")
		return nil
	}
	t := ts.AsTime()
	return &t
}

func validateSpendID(c *validator, field, id string) {
	switch {
	case id == "":
		c.add(field, "required")
	case len(id) > maxSpendIDLen || !utf8.ValidString(id):
		c.add(field, "must be at most %d bytes of UTF-8", maxSpendIDLen)
	}
}

func (s *spendService) GetSpend(ctx context.Context, req *connect.Request[adminv1.GetSpendRequest]) (*connect.Response[adminv1.GetSpendResponse], error) {
	p := principal(ctx)
	m := req.Msg
	c := &validator{}
	scope, ok := spendScopeNames[m.GetScope()]
	if !ok {
		c.add("scope", "required: one of SPEND_SCOPE_ORG, _TEAM, _USER, _KEY, _CUSTOMER, _MODEL_GROUP, _DEPLOYMENT, _TAG")
	}
	id := m.GetId()
	validateSpendID(c, "id", id)
	if m.GetOrgId() != "" {
		validateSpendID(c, "org_id", m.GetOrgId())
		if scope == store.SpendScopeOrg && m.GetOrgId() != id {
			c.add("org_id", "must be empty or equal to id for SPEND_SCOPE_ORG")
		}
	}
	// Whole UTC days: start rounds down, end rounds up.
	now := s.store.Now()
	start, end := floorDay(now.Add(-defaultSpendWindow)), floorDay(now).Add(day)
	if t := checkTime(c, "start_time", m.StartTime); t != nil {
		start = floorDay(*t)
	}
	if t := checkTime(c, "end_time", m.EndTime); t != nil {
		end = ceilDay(*t)
	}
	switch {
	case !start.Before(end):
		c.add("end_time", "must be after start_time (the window is [%s, %s) in whole UTC days)", start.Format(time.DateOnly), end.Format(time.DateOnly))
	case end.Sub(start) > maxSpendWindow:
		c.add("end_time", "the window is %d days; at most %d", int(end.Sub(start)/day), int(maxSpendWindow/day))
	}
	if err := c.err(); err != nil {
		return nil, err
	}

	// The org whose rows are summed: a platform token's choice (or every
	// org), otherwise the caller's own org.
	org := m.GetOrgId()
	if p.Scope != authz.ScopePlatform {
		if org != "" && org != p.OrgID {
			return nil, authz.Check(ctx, p, authz.Read, authz.OrgTarget(org, "spend of org "+org))
		}
		org = p.OrgID
	}
	what := "spend of " + scope + " " + id
	var target authz.Target
	switch scope {
	case store.SpendScopeOrg:
		target, org = authz.OrgTarget(id, what), id
	case store.SpendScopeTeam:
		target = authz.TeamTarget(org, "", what)
		if p.Scope == authz.ScopeTeam {
			target = authz.TeamTarget(org, id, what)
		}
	case store.SpendScopeKey:
		target = authz.TeamTarget(org, "", what)
		if p.Scope == authz.ScopeTeam {
			// Only keys of the caller's team; an unknown key or one of
			// another team leaves the target team-less, which is refused.
			k, err := s.store.KeyGet(ctx, store.Tenant{OrgID: p.OrgID, TeamID: p.TeamID}, id)
			switch {
			case err == nil:
				target = authz.TeamTarget(org, k.TeamID, what)
			case !isNotFound(err):
				authz.MarkChecked(ctx)
				return nil, err
			}
		}
	default:
		// Customers, model groups, deployments and tags span teams: org
		// and platform tokens only (team tokens get a team-less target).
		target = authz.TeamTarget(org, "", what)
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	t, err := s.store.SpendSum(ctx, store.SpendSumQuery{Scope: scope, ScopeID: id, OrgID: org, Start: start, End: end})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetSpendResponse{
		SpendUsd: t.CostUSD, Requests: t.Requests, PromptTokens: t.PromptTokens,
		CompletionTokens: t.CompletionTokens, CachedTokens: t.CachedTokens,
	}), nil
}

func spendLogToProto(l store.SpendLog) *adminv1.SpendLog {
	return &adminv1.SpendLog{
		RequestId: l.RequestID, Time: timestamppb.New(l.At), OrgId: l.OrgID, TeamId: l.TeamID, UserId: l.UserID,
		KeyId: l.KeyID, Project: l.Project, Customer: l.Customer, AgentId: l.AgentID, SessionId: l.SessionID,
		Tags: l.Tags, TrafficClass: l.TrafficClass, ModelGroup: l.ModelGroup, DeploymentId: l.DeploymentID,
		PromptTokens: l.PromptTokens, CompletionTokens: l.CompletionTokens, CachedTokens: l.CachedTokens,
		CacheCreationTokens: l.CacheCreationTokens, CostUsd: l.CostUSD, Status: l.Status, ErrorCode: l.ErrorCode, LatencyMs: l.LatencyMS, TtftMs: l.TTFTMS,
		Attempts: l.Attempts, Route: l.Route,
	}
}

// spendCursor is the keyset page token of ListSpendLogs:
// "<unix microseconds>|<request id>" of the last log of the page.
func spendCursor(l store.SpendLog) string {
	return strconv.FormatInt(l.At.UnixMicro(), 10) + "|" + l.RequestID
}

// timeCursor decodes the page token after of a list ordered by time and
// id (spendCursor's form; "" is the first page), adding to c when it is
// not one.
func timeCursor(c *validator, after string) (time.Time, string) {
	if after == "" {
		return time.Time{}, ""
	}
	at, id, ok := parseSpendCursor(after)
	if !ok {
		c.add("page_token", "not a token from a previous page")
	}
	return at, id
}

func parseSpendCursor(s string) (time.Time, string, bool) {
	us, rid, ok := strings.Cut(s, "|")
	if !ok || rid == "" {
		return time.Time{}, "", false
	}
	n, err := strconv.ParseInt(us, 10, 64)
	if err != nil || n <= 0 {
		return time.Time{}, "", false
	}
	return time.UnixMicro(n).UTC(), rid, true
}

func (s *spendService) ListSpendLogs(ctx context.Context, req *connect.Request[adminv1.ListSpendLogsRequest]) (*connect.Response[adminv1.ListSpendLogsResponse], error) {
	p := principal(ctx)
	m := req.Msg
	t := tenant(ctx)
	target := tokenTarget(p.Scope, p.OrgID, p.TeamID, "spend logs")
	switch {
	case m.GetOrgId() != "" && t.OrgID != "" && m.GetOrgId() != t.OrgID:
		target = authz.OrgTarget(m.GetOrgId(), "spend logs of org "+m.GetOrgId())
	case m.GetTeamId() != "" && t.TeamID != "" && m.GetTeamId() != t.TeamID:
		target = authz.TeamTarget(p.OrgID, m.GetTeamId(), "spend logs of team "+m.GetTeamId())
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	q := store.SpendLogQuery{Tenant: t, UserID: m.GetUserId(), KeyID: m.GetKeyId(), ModelGroup: m.GetModelGroup()}
	if q.OrgID == "" {
		q.OrgID = m.GetOrgId()
	}
	if q.TeamID == "" {
		q.TeamID = m.GetTeamId()
	}
	c := &validator{}
	q.Start = checkTime(c, "start_time", m.StartTime)
	q.End = checkTime(c, "end_time", m.EndTime)
	if q.Start != nil && q.End != nil && !q.Start.Before(*q.End) {
		c.add("end_time", "must be after start_time")
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	q.AfterAt, q.AfterID = timeCursor(c, after)
	if err := c.err(); err != nil {
		return nil, err
	}
	rows, err := s.store.SpendLogList(ctx, q, limit)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListSpendLogsResponse{}
	resp.Logs, resp.NextPageToken, err = page(rows, limit, infallible(spendLogToProto), spendCursor)
	return reply(resp, err)
}
