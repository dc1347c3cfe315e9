package main

import (
	"context"
	"flag"
	"strconv"

	"google.golang.org/protobuf/proto"

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
		group("webhook", "manage the org's alert webhooks (signed POSTs of every alert)", []*command{
			leaf("create", "URL", "register an endpoint; prints its signing secret once", runWebhookCreate),
			listCommand("", "list webhooks", webhookColumns, func(fs *flag.FlagSet) fetchPage[*adminv1.AlertWebhook] {
				req := &adminv1.ListAlertWebhooksRequest{}
				fs.StringVar(&req.OrgId, "org", "", "only webhooks of this org (default: your token's org; platform tokens: every org)")
				return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.AlertWebhook, string, error) {
					req.PageSize, req.PageToken = size, tok
					r, err := call(ctx, c.alerts.ListAlertWebhooks, req)
					return r.GetWebhooks(), r.GetNextPageToken(), err
				}
			}),
			deleteCommand("webhook", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
				return call(ctx, c.alerts.DeleteAlertWebhook, &adminv1.DeleteAlertWebhookRequest{Id: id})
			}),
			leaf("rotate", "WEBHOOK_ID", "give an endpoint a new signing secret, printed once; --grace keeps the old one signing too", runWebhookRotate),
		}, "webhooks"),
		group("deliveries", "delivery state of alerts to webhooks: pending, delivered, dead (the dead-letter list)", []*command{
			listCommand("", "list deliveries, newest first", deliveryColumns, deliveryList("")),
			renamed("dead", listCommand("", "the dead-letter list: deliveries whose every attempt failed", deliveryColumns, deliveryList(deadState))),
			idCommand("retry", "DELIVERY", "send a dead delivery again (same delivery id, attempts reset)", func(ctx context.Context, c *clients, id string) (proto.Message, error) {
				r, err := call(ctx, c.alerts.RetryAlertDelivery, &adminv1.RetryAlertDeliveryRequest{DeliveryId: id})
				return r.GetDelivery(), err
			}),
		}, "delivery"),
	}, "alert")
}

// deadState is the state of a delivery in the dead-letter list.
const deadState = "dead"

var webhookColumns = []column[*adminv1.AlertWebhook]{
	{"ID", (*adminv1.AlertWebhook).GetId},
	{"ORG", (*adminv1.AlertWebhook).GetOrgId},
	{"URL", (*adminv1.AlertWebhook).GetUrl},
	{"DESCRIPTION", (*adminv1.AlertWebhook).GetDescription},
	{"CREATED", func(w *adminv1.AlertWebhook) string { return formatTime(w.GetCreateTime()) }},
	{"OLD SECRET SIGNS UNTIL", func(w *adminv1.AlertWebhook) string { return formatTime(w.GetPreviousSecretValidUntil()) }},
}

var deliveryColumns = []column[*adminv1.AlertDelivery]{
	{"DELIVERY", (*adminv1.AlertDelivery).GetDeliveryId},
	{"ALERT", (*adminv1.AlertDelivery).GetAlertId},
	{"WEBHOOK", (*adminv1.AlertDelivery).GetWebhookId},
	{"STATE", (*adminv1.AlertDelivery).GetState},
	{"ATTEMPTS", func(d *adminv1.AlertDelivery) string { return strconv.Itoa(int(d.GetAttempts())) }},
	{"NEXT ATTEMPT", func(d *adminv1.AlertDelivery) string { return formatTime(d.GetNextAttemptTime()) }},
	{"DELIVERED", func(d *adminv1.AlertDelivery) string { return formatTime(d.GetDeliveredTime()) }},
	{"LAST ERROR", (*adminv1.AlertDelivery).GetLastError},
}

func deliveryList(state string) func(fs *flag.FlagSet) fetchPage[*adminv1.AlertDelivery] {
	return func(fs *flag.FlagSet) fetchPage[*adminv1.AlertDelivery] {
		req := &adminv1.ListAlertDeliveriesRequest{State: state}
		fs.StringVar(&req.OrgId, "org", "", "only deliveries of this org (default: your token's org; platform tokens: every org)")
		fs.StringVar(&req.WebhookId, "webhook", "", "only deliveries to this webhook")
		if state == "" {
			fs.StringVar(&req.State, "state", "", "only deliveries in this state: pending, delivered or dead")
		}
		return func(ctx context.Context, c *clients, _ []string, size int32, tok string) ([]*adminv1.AlertDelivery, string, error) {
			req.PageSize, req.PageToken = size, tok
			r, err := call(ctx, c.alerts.ListAlertDeliveries, req)
			return r.GetDeliveries(), r.GetNextPageToken(), err
		}
	}
}

func runWebhookCreate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.CreateAlertWebhookRequest{}
	fs.StringVar(&req.OrgId, "org", "", "org whose alerts it receives (default: your token's org; required with a platform token)")
	fs.StringVar(&req.Description, "description", "", "what the endpoint is")
	pos, cl, p, err := a.parseConnect(fs, c, 1, 1)
	if err != nil {
		return err
	}
	req.Url = pos[0]
	r, err := call(ctx, cl.alerts.CreateAlertWebhook, req)
	if err != nil {
		return err
	}
	return p.one(r, r.GetWebhook(), [2]string{"secret (shown once)", r.GetSecret()})
}

func runWebhookRotate(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	req := &adminv1.RotateAlertWebhookSecretRequest{}
	fs.StringVar(&req.GracePeriod, "grace", "", "how long the old secret keeps signing besides the new one (`DURATION`: 90s, 24h, 7d; at most 30d); default none")
	pos, cl, p, err := a.parseConnect(fs, c, 1, 1)
	if err != nil {
		return err
	}
	req.Id = pos[0]
	r, err := call(ctx, cl.alerts.RotateAlertWebhookSecret, req)
	if err != nil {
		return err
	}
	return p.one(r, r.GetWebhook(), [2]string{"secret (shown once)", r.GetSecret()})
}
