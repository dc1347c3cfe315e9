package main

import (
	"context"
	"flag"
	"strconv"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Budget alerts (SPEC §8.3): thresholds of soft budgets and hard caps the
// data planes saw crossed, once per scope, threshold and window. Org and
// team tokens see only their own tenant's alerts.

var alertColumns = []column[*adminv1.Alert]{
	{"TIME", func(a *adminv1.Alert) string { return formatTime(a.GetTime()) }},
	{"ORG", (*adminv1.Alert).GetOrgId},
	{"TEAM", (*adminv1.Alert).GetTeamId},
	{"SCOPE", (*adminv1.Alert).GetScopeKind},
	{"SCOPE ID", (*adminv1.Alert).GetScopeId},
	{"THRESHOLD", func(a *adminv1.Alert) string {
		if a.GetThresholdPercent() == 0 {
			return "soft"
		}
		return strconv.Itoa(int(a.GetThresholdPercent())) + "%"
	}},
	{"SPEND", func(a *adminv1.Alert) string { return formatUSD(a.GetSpendUsd()) }},
	// The amount the threshold is of: the soft budget, or the cap.
	{"BUDGET", func(a *adminv1.Alert) string {
		if a.GetThresholdPercent() == 0 {
			return formatUSD(a.GetSoftBudgetUsd())
		}
		return formatUSD(a.GetCapUsd())
	}},
	{"WINDOW", func(a *adminv1.Alert) string {
		return a.GetBudgetDuration() + " from " + formatTime(a.GetWindowStart())
	}},
	{"REGION", (*adminv1.Alert).GetRegion},
	{"REQUEST", (*adminv1.Alert).GetRequestId},
}

func alertsCommand() *command {
	return group("alerts", "read budget alerts (soft budgets and cap thresholds crossed)", []*command{
		listCommand("", "list budget alerts, newest first", alertColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.Alert] {
			req := &adminv1.ListAlertsRequest{}
			fs.StringVar(&req.OrgId, "org", "", "only alerts of this org (platform tokens; org and team tokens are confined to their own)")
			fs.StringVar(&req.TeamId, "team", "", "only alerts of scopes of this team")
			fs.StringVar(&req.ScopeKind, "scope-kind", "", "only this kind of scope: key, user, member, team, org, customer, key_model or team_model")
			fs.StringVar(&req.ScopeId, "scope-id", "", "only this scope: its id (team/user for members, owner/model group for key_model and team_model)")
			fs.Var(&sinceValue{&req.Since}, "since", "only alerts fired at or after this time: RFC 3339, a date, or a duration ago (1h, 7d)")
			return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.Alert, string, error) {
				req.PageSize, req.PageToken = size, tok
				r, err := call(ctx, c.alerts.ListAlerts, req)
				return r.GetAlerts(), r.GetNextPageToken(), err
			}
		}),
	}, "alert")
}
