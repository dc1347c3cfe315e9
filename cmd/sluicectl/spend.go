package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Spend commands (SPEC §9.2): totals per scope from the daily aggregates,
// and the per-request ledger. Org and team tokens see only their own
// tenant's spend.

func formatUSD(v float64) string { return "$" + strconv.FormatFloat(v, 'f', 6, 64) }

var spendLogColumns = []column[*adminv1.SpendLog]{
	{"TIME", func(l *adminv1.SpendLog) string { return formatTime(l.GetTime()) }},
	{"REQUEST", (*adminv1.SpendLog).GetRequestId},
	{"ORG", (*adminv1.SpendLog).GetOrgId},
	{"TEAM", (*adminv1.SpendLog).GetTeamId},
	{"KEY", (*adminv1.SpendLog).GetKeyId},
	{"MODEL GROUP", (*adminv1.SpendLog).GetModelGroup},
	{"DEPLOYMENT", (*adminv1.SpendLog).GetDeploymentId},
	{"STATUS", func(l *adminv1.SpendLog) string {
		s := strconv.Itoa(int(l.GetStatus()))
		if l.GetErrorCode() != "" {
			s += " " + l.GetErrorCode()
		}
		return s
	}},
	{"TOKENS IN/OUT", func(l *adminv1.SpendLog) string {
		return fmt.Sprintf("%d/%d", l.GetPromptTokens(), l.GetCompletionTokens())
	}},
	{"COST", func(l *adminv1.SpendLog) string { return formatUSD(l.GetCostUsd()) }},
	{"LATENCY", func(l *adminv1.SpendLog) string { return strconv.FormatInt(l.GetLatencyMs(), 10) + "ms" }},
}

func spendCommand() *command {
	return group("spend", "read the usage ledger: totals per scope and per-request logs", []*command{
		leaf("get", "", "sum spend of one org, team, user, key, customer, model group, deployment or tag over whole UTC days", runSpendGet, "sum"),
		leaf("logs", "", "list the ledger's per-request records, newest first", runSpendLogs, "log"),
	})
}

func runSpendGet(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.GetSpendRequest{}
	fs.Var(newEnum(&req.Scope, adminv1.SpendScope_value, "SPEND_SCOPE_"), "scope",
		"what to sum: org, team, user, key, customer, model_group, deployment or tag (required)")
	fs.StringVar(&req.Id, "id", "", "id of the scope: org, team, user or key id; customer external id; model group name; deployment id; tag (required)")
	fs.StringVar(&req.OrgId, "org", "", "only spend of this org (platform tokens; org tokens are always confined to their org)")
	fs.Var(&sinceValue{&req.StartTime}, "since", "first day: RFC 3339, a date, or a duration ago (7d); default 30 days ago")
	fs.Var(&sinceValue{&req.EndTime}, "until", "end (exclusive, rounded up to a whole UTC day): RFC 3339, a date, or a duration ago; default tomorrow")
	if _, err := a.parse(fs, c, 0, 0); err != nil {
		return err
	}
	var missing []string
	if req.Scope == adminv1.SpendScope_SPEND_SCOPE_UNSPECIFIED {
		missing = append(missing, "--scope")
	}
	if req.Id == "" {
		missing = append(missing, "--id")
	}
	if len(missing) > 0 {
		verb := "is"
		if len(missing) > 1 {
			verb = "are"
		}
		return fmt.Errorf("%s: %s %s required (see 'sluicectl %s -h')", c.path, strings.Join(missing, " and "), verb, c.path)
	}
	cl, p, err := a.connect()
	if err != nil {
		return err
	}
	r, err := call(ctx, cl.spend.GetSpend, req)
	if err != nil {
		return err
	}
	if p.format != outTable {
		return p.message(r)
	}
	_, err = fmt.Fprintf(a.stdout, "Spend of %s %s: %s over %d requests (tokens: %d in, %d out, %d cached).\n",
		enumName(req.Scope.Descriptor(), req.Scope.Number()), req.Id, formatUSD(r.GetSpendUsd()), r.GetRequests(),
		r.GetPromptTokens(), r.GetCompletionTokens(), r.GetCachedTokens())
	return err
}

func runSpendLogs(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	limit := limitFlag(fs)
	req := &adminv1.ListSpendLogsRequest{}
	fs.StringVar(&req.OrgId, "org", "", "only requests of this org")
	fs.StringVar(&req.TeamId, "team", "", "only requests of this team")
	fs.StringVar(&req.UserId, "user", "", "only requests of this user")
	fs.StringVar(&req.KeyId, "key", "", "only requests made with this key")
	fs.StringVar(&req.ModelGroup, "model-group", "", "only requests to this model group")
	fs.Var(&sinceValue{&req.StartTime}, "since", "only requests at or after this time: RFC 3339, a date, or a duration ago (1h, 7d)")
	fs.Var(&sinceValue{&req.EndTime}, "until", "only requests before this time: RFC 3339, a date, or a duration ago")
	_, cl, p, err := a.parseConnect(fs, c, 0, 0)
	if err != nil {
		return err
	}
	logs, err := collect(ctx, *limit, func(ctx context.Context, size int32, tok string) ([]*adminv1.SpendLog, string, error) {
		req.PageSize, req.PageToken = size, tok
		r, err := call(ctx, cl.spend.ListSpendLogs, req)
		return r.GetLogs(), r.GetNextPageToken(), err
	})
	if err != nil {
		return err
	}
	return list(p, logs, spendLogColumns)
}
