package admin

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/alerts"
	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Alert webhooks and their deliveries (docs/alerts.md#webhooks). Webhooks
// are org-level objects: org editors and admins (and platform tokens)
// manage their org's, viewers read them; team tokens reach none.

const (
	objWebhook = "alert_webhook"
	// maxWebhooksPerOrg bounds an org's endpoints (each alert is one
	// delivery per endpoint).
	maxWebhooksPerOrg = 10
	maxWebhookURLLen  = 2000
)

var deliveryStates = []string{store.DeliveryPending, store.DeliveryDelivered, store.DeliveryDead}

func webhookToProto(w store.Webhook) *adminv1.AlertWebhook {
	out := &adminv1.AlertWebhook{Id: w.ID, OrgId: w.OrgID, Url: w.URL, Description: w.Description,
		CreateTime: timestamppb.New(w.CreatedAt), CreatedBy: w.CreatedBy}
	if w.SecretRotatedAt != nil {
		out.SecretRotateTime = timestamppb.New(*w.SecretRotatedAt)
	}
	if w.PreviousValidUntil != nil {
		out.PreviousSecretValidUntil = timestamppb.New(*w.PreviousValidUntil)
	}
	return out
}

func deliveryToProto(d store.Delivery) *adminv1.AlertDelivery {
	out := &adminv1.AlertDelivery{DeliveryId: d.ID, AlertId: d.AlertID, WebhookId: d.WebhookID, OrgId: d.OrgID, State: d.State,
		Attempts: int32(d.Attempts), LastError: d.LastError, CreateTime: timestamppb.New(d.CreatedAt)}
	if d.State == store.DeliveryPending {
		out.NextAttemptTime = timestamppb.New(d.NextAttemptAt)
	}
	if d.DeliveredAt != nil {
		out.DeliveredTime = timestamppb.New(*d.DeliveredAt)
	}
	return out
}

// validateWebhookURL: http or https, a host, no credentials or fragment.
func validateWebhookURL(c *validator, s string) {
	if s == "" {
		c.add("url", "required: the endpoint alerts are POSTed to, e.g. https://hooks.example.com/sluice")
		return
	}
	if len(s) > maxWebhookURLLen {
		c.add("url", "must be at most %d bytes", maxWebhookURLLen)
		return
	}
	u, err := url.Parse(s)
	switch {
	case err != nil:
		c.add("url", "is not a URL")
	case u.Scheme != "http" && u.Scheme != "https":
		c.add("url", "must be an http:// or https:// URL (got scheme %q)", u.Scheme)
	case u.Hostname() == "":
		c.add("url", "must name a host")
	case u.User != nil:
		c.add("url", "must not contain credentials; verify requests by their signature instead")
	case u.Fragment != "":
		c.add("url", "must not have a fragment")
	}
}

// webhookOrg is the org a webhook request is about: the given one, else
// the caller's (platform tokens must name one when required).
func webhookOrg(p *authz.Principal, given string) string {
	if given != "" {
		return given
	}
	return p.OrgID
}

// newWebhookSecret returns a Standard Webhooks style secret: "whsec_" and
// the base64 of 32 random bytes.
func newWebhookSecret() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return alerts.SecretPrefix + base64.StdEncoding.EncodeToString(b[:])
}

func (s *alertService) CreateAlertWebhook(ctx context.Context, req *connect.Request[adminv1.CreateAlertWebhookRequest]) (*connect.Response[adminv1.CreateAlertWebhookResponse], error) {
	p := principal(ctx)
	m := req.Msg
	org := webhookOrg(p, m.GetOrgId())
	if org == "" {
		authz.MarkChecked(ctx) // nothing to authorise against yet
		return nil, invalid("org_id", "required with a platform token")
	}
	if err := authz.Check(ctx, p, authz.Write, authz.OrgTarget(org, "alert webhooks of org "+org)); err != nil {
		return nil, err
	}
	c := &validator{}
	validateWebhookURL(c, m.GetUrl())
	validateDescription(c, m.GetDescription())
	if err := c.err(); err != nil {
		return nil, err
	}
	if s.keys == nil {
		return nil, errNoKeyRing
	}
	secret := newWebhookSecret()
	w := store.Webhook{ID: ids.New(ids.Webhook), OrgID: org, URL: m.GetUrl(), Description: m.GetDescription(),
		SecretCiphertext: s.keys.Seal([]byte(secret)), CreatedBy: p.ID}
	var out *adminv1.AlertWebhook
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if _, err := tx.OrgGetForUpdate(ctx, tenant(ctx), org); err != nil {
			return err
		}
		n, err := tx.WebhookCountForOrg(ctx, org)
		if err != nil {
			return err
		}
		if n >= maxWebhooksPerOrg {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: "org " + org + " already has " + strconv.Itoa(n) + " webhooks, the most an org may have"}
		}
		if err := tx.WebhookInsert(ctx, &w); err != nil {
			return err
		}
		out = webhookToProto(w)
		return tx.Audit(ctx, audit.ActionCreated, objWebhook, w.ID, org, "", nil, auditJSON(out))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateAlertWebhookResponse{Webhook: out, Secret: secret}), nil
}

func (s *alertService) ListAlertWebhooks(ctx context.Context, req *connect.Request[adminv1.ListAlertWebhooksRequest]) (*connect.Response[adminv1.ListAlertWebhooksResponse], error) {
	p := principal(ctx)
	t := store.Tenant{OrgID: webhookOrg(p, req.Msg.GetOrgId())}
	target := authz.OrgTarget(t.OrgID, "alert webhooks of org "+t.OrgID)
	if t.OrgID == "" {
		target = authz.PlatformTarget("alert webhooks of every org")
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.WebhookList(ctx, t, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListAlertWebhooksResponse{}
	resp.Webhooks, resp.NextPageToken, err = page(rows, limit, infallible(webhookToProto), func(w store.Webhook) string { return w.ID })
	return reply(resp, err)
}

func (s *alertService) DeleteAlertWebhook(ctx context.Context, req *connect.Request[adminv1.DeleteAlertWebhookRequest]) (*connect.Response[adminv1.DeleteAlertWebhookResponse], error) {
	if err := requireID("id", req.Msg.GetId()); err != nil {
		authz.MarkChecked(ctx)
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		w, err := tx.WebhookGet(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			authz.MarkChecked(ctx) // another org's webhook is not found
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(w.OrgID, "webhook "+w.ID)); err != nil {
			return err
		}
		if err := tx.WebhookDelete(ctx, w.ID); err != nil {
			return err
		}
		return tx.Audit(ctx, audit.ActionDeleted, objWebhook, w.ID, w.OrgID, "", auditJSON(webhookToProto(w)), nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteAlertWebhookResponse{}), nil
}

// RotateAlertWebhookSecret gives a webhook a new secret (returned once).
// With a grace period the current secret keeps signing besides the new
// one until it ends; rotating again during a grace replaces the previous
// secret by the one being rotated out (one previous secret at a time).
func (s *alertService) RotateAlertWebhookSecret(ctx context.Context, req *connect.Request[adminv1.RotateAlertWebhookSecretRequest]) (*connect.Response[adminv1.RotateAlertWebhookSecretResponse], error) {
	if err := requireID("id", req.Msg.GetId()); err != nil {
		authz.MarkChecked(ctx)
		return nil, err
	}
	grace, err := parseGracePeriod(req.Msg.GetGracePeriod())
	if err != nil {
		authz.MarkChecked(ctx)
		return nil, err
	}
	if s.keys == nil {
		authz.MarkChecked(ctx)
		return nil, errNoKeyRing
	}
	secret := newWebhookSecret()
	sealed := s.keys.Seal([]byte(secret))
	var out *adminv1.AlertWebhook
	err = s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		w, err := tx.WebhookGetForUpdate(ctx, tenant(ctx), req.Msg.GetId())
		if err != nil {
			authz.MarkChecked(ctx) // another org's webhook is not found
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(w.OrgID, "webhook "+w.ID)); err != nil {
			return err
		}
		before := webhookToProto(w)
		var until *time.Time
		if grace > 0 {
			u := tx.Now().Add(grace).Truncate(time.Microsecond)
			until = &u
		}
		if err := tx.WebhookRotate(ctx, &w, sealed, until); err != nil {
			return err
		}
		out = webhookToProto(w)
		after, err := rotationAfter(out, grace, until)
		if err != nil {
			return err
		}
		return tx.Audit(ctx, audit.ActionRotated, objWebhook, w.ID, w.OrgID, "", auditJSON(before), after)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RotateAlertWebhookSecretResponse{Webhook: out, Secret: secret}), nil
}

func (s *alertService) ListAlertDeliveries(ctx context.Context, req *connect.Request[adminv1.ListAlertDeliveriesRequest]) (*connect.Response[adminv1.ListAlertDeliveriesResponse], error) {
	p := principal(ctx)
	m := req.Msg
	q := store.DeliveryQuery{OrgID: webhookOrg(p, m.GetOrgId()), WebhookID: m.GetWebhookId(), State: m.GetState()}
	target := authz.OrgTarget(q.OrgID, "alert deliveries of org "+q.OrgID)
	if q.OrgID == "" {
		target = authz.PlatformTarget("alert deliveries of every org")
	}
	if err := authz.Check(ctx, p, authz.Read, target); err != nil {
		return nil, err
	}
	c := &validator{}
	if st := m.GetState(); st != "" && !slices.Contains(deliveryStates, st) {
		c.add("state", "must be one of %s (got %q)", strings.Join(deliveryStates, ", "), st)
	}
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	q.AfterAt, q.AfterID = timeCursor(c, after)
	if err := c.err(); err != nil {
		return nil, err
	}
	rows, err := s.store.DeliveryList(ctx, q, limit)
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListAlertDeliveriesResponse{}
	resp.Deliveries, resp.NextPageToken, err = page(rows, limit, infallible(deliveryToProto), func(d store.Delivery) string {
		return strconv.FormatInt(d.CreatedAt.UnixMicro(), 10) + "|" + d.ID
	})
	return reply(resp, err)
}

func (s *alertService) RetryAlertDelivery(ctx context.Context, req *connect.Request[adminv1.RetryAlertDeliveryRequest]) (*connect.Response[adminv1.RetryAlertDeliveryResponse], error) {
	if err := requireID("delivery_id", req.Msg.GetDeliveryId()); err != nil {
		authz.MarkChecked(ctx)
		return nil, err
	}
	var out *adminv1.AlertDelivery
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		d, err := tx.DeliveryGet(ctx, tenant(ctx), req.Msg.GetDeliveryId())
		if err != nil {
			authz.MarkChecked(ctx)
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(d.OrgID, "delivery "+d.ID)); err != nil {
			return err
		}
		if d.State != store.DeliveryDead {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: "delivery " + d.ID + " is " + d.State + "; only dead deliveries are retried"}
		}
		before := deliveryToProto(d)
		if err := tx.DeliveryRetry(ctx, &d); err != nil {
			return err
		}
		out = deliveryToProto(d)
		return tx.Audit(ctx, audit.ActionUpdated, "alert_delivery", d.ID, d.OrgID, "", auditJSON(before), auditJSON(out))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RetryAlertDeliveryResponse{Delivery: out}), nil
}
