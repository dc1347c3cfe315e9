package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Webhook is an endpoint an org's budget alerts are POSTed to. Its signing
// secret is only ever held sealed by the key ring (SecretCiphertext).
type Webhook struct {
	ID               string
	OrgID            string
	URL              string
	Description      string
	SecretCiphertext []byte
	CreatedAt        time.Time
	CreatedBy        string
	// PreviousSecretCiphertext (sealed) signs requests besides the current
	// secret until PreviousValidUntil (docs/alerts.md, "Rotating the
	// secret"); both nil when no grace was given.
	PreviousSecretCiphertext []byte
	PreviousValidUntil       *time.Time
	// SecretRotatedAt is the last rotation (nil: never rotated).
	SecretRotatedAt *time.Time
}

func webhookFromRow(r dbsqlc.AlertWebhook) Webhook {
	return Webhook{ID: r.ID, OrgID: r.OrgID, URL: r.Url, Description: r.Description, SecretCiphertext: r.SecretCiphertext,
		CreatedAt: r.CreatedAt.UTC(), CreatedBy: r.CreatedBy, PreviousSecretCiphertext: r.PreviousSecretCiphertext,
		PreviousValidUntil: utcPtr(r.PreviousValidUntil), SecretRotatedAt: utcPtr(r.SecretRotatedAt)}
}

func utcPtr(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	u := t.UTC()
	return &u
}

// Delivery states.
const (
	DeliveryPending   = "pending"
	DeliveryDelivered = "delivered"
	DeliveryDead      = "dead"
)

// Delivery is one alert to one webhook (the delivery outbox row).
type Delivery struct {
	ID            string
	AlertID       string
	WebhookID     string
	OrgID         string
	State         string
	Attempts      int
	NextAttemptAt time.Time
	LastError     string
	CreatedAt     time.Time
	DeliveredAt   *time.Time
}

func deliveryFromRow(r dbsqlc.AlertDelivery) Delivery {
	return Delivery{ID: r.DeliveryID, AlertID: r.AlertID, WebhookID: r.WebhookID, OrgID: r.OrgID, State: r.State,
		Attempts: int(r.Attempts), NextAttemptAt: r.NextAttemptAt.UTC(), LastError: r.LastError, CreatedAt: r.CreatedAt.UTC(),
		DeliveredAt: r.DeliveredAt}
}

// WebhookInsert stores w (CreatedAt is the transaction time).
func (t *Tx) WebhookInsert(ctx context.Context, w *Webhook) error {
	w.CreatedAt = t.now
	return translate(t.q.WebhookInsert(ctx, t.tx, dbsqlc.WebhookInsertParams{ID: w.ID, OrgID: w.OrgID, Url: w.URL,
		Description: w.Description, SecretCiphertext: w.SecretCiphertext, CreatedAt: t.now, CreatedBy: w.CreatedBy}))
}

// WebhookCountForOrg counts org's webhooks.
func (t *Tx) WebhookCountForOrg(ctx context.Context, orgID string) (int, error) {
	n, err := t.q.WebhookCountForOrg(ctx, t.tx, orgID)
	if err != nil {
		return 0, fmt.Errorf("count webhooks of org %s: %w", orgID, err)
	}
	return int(n), nil
}

// WebhookGet returns webhook id if tn may see it.
func (t *Tx) WebhookGet(ctx context.Context, tn Tenant, id string) (Webhook, error) {
	r, err := t.q.WebhookGet(ctx, t.tx, dbsqlc.WebhookGetParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return Webhook{}, orNotFound(err, "webhook "+id)
	}
	return webhookFromRow(r), nil
}

// WebhookGetForUpdate returns webhook id locked for the rest of the
// transaction.
func (t *Tx) WebhookGetForUpdate(ctx context.Context, tn Tenant, id string) (Webhook, error) {
	r, err := t.q.WebhookGetForUpdate(ctx, t.tx, dbsqlc.WebhookGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return Webhook{}, orNotFound(err, "webhook "+id)
	}
	return webhookFromRow(r), nil
}

// WebhookRotate gives w the sealed secret sealed: with until set, its
// current secret becomes the previous one, signing besides the new one
// until then; without, the new secret alone signs (any previous one is
// dropped). w is updated to the stored state.
func (t *Tx) WebhookRotate(ctx context.Context, w *Webhook, sealed []byte, until *time.Time) error {
	var prev []byte
	if until != nil {
		prev = w.SecretCiphertext
	}
	now := t.now
	if err := translate(t.q.WebhookRotate(ctx, t.tx, dbsqlc.WebhookRotateParams{ID: w.ID, SecretCiphertext: sealed,
		PreviousSecretCiphertext: prev, PreviousValidUntil: until, RotatedAt: &now})); err != nil {
		return err
	}
	w.SecretCiphertext, w.PreviousSecretCiphertext, w.PreviousValidUntil, w.SecretRotatedAt = sealed, prev, until, &now
	return nil
}

// WebhookDelete deletes webhook id and its deliveries.
func (t *Tx) WebhookDelete(ctx context.Context, id string) error {
	return translate(t.q.WebhookDelete(ctx, t.tx, id))
}

// WebhookList returns a page of the webhooks of tn's org (every org for
// an empty tenant), in id order.
func (s *Store) WebhookList(ctx context.Context, tn Tenant, p Page) ([]Webhook, error) {
	rows, err := s.q.WebhookList(ctx, s.pool, dbsqlc.WebhookListParams{AfterID: p.After, OrgID: optStr(tn.OrgID), Lim: int32(p.Limit)})
	if err != nil {
		return nil, fmt.Errorf("list webhooks: %w", err)
	}
	out := make([]Webhook, len(rows))
	for i, r := range rows {
		out[i] = webhookFromRow(r)
	}
	return out, nil
}

// DeliveryQuery filters DeliveryList ("" is any).
type DeliveryQuery struct {
	OrgID, WebhookID, State string
	// AfterAt and AfterID are the keyset cursor (zero AfterAt: first
	// page).
	AfterAt time.Time
	AfterID string
}

// DeliveryList returns up to limit deliveries matching q, newest first.
func (s *Store) DeliveryList(ctx context.Context, q DeliveryQuery, limit int) ([]Delivery, error) {
	p := dbsqlc.DeliveryListParams{OrgID: optStr(q.OrgID), WebhookID: optStr(q.WebhookID), State: optStr(q.State),
		AfterID: q.AfterID, Lim: int32(limit)}
	if !q.AfterAt.IsZero() {
		at := q.AfterAt
		p.AfterAt = &at
	}
	rows, err := s.q.DeliveryList(ctx, s.pool, p)
	if err != nil {
		return nil, fmt.Errorf("list alert deliveries: %w", err)
	}
	out := make([]Delivery, len(rows))
	for i, r := range rows {
		out[i] = deliveryFromRow(r)
	}
	return out, nil
}

// DeliveryGet returns delivery id if tn may see it.
func (t *Tx) DeliveryGet(ctx context.Context, tn Tenant, id string) (Delivery, error) {
	r, err := t.q.DeliveryGet(ctx, t.tx, dbsqlc.DeliveryGetParams{DeliveryID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return Delivery{}, orNotFound(err, "delivery "+id)
	}
	return deliveryFromRow(r), nil
}

// DeliveryRetry puts a dead delivery back to pending with its attempts
// reset; d is updated.
func (t *Tx) DeliveryRetry(ctx context.Context, d *Delivery) error {
	if err := translate(t.q.DeliveryRetry(ctx, t.tx, dbsqlc.DeliveryRetryParams{DeliveryID: d.ID, Now: t.now})); err != nil {
		return err
	}
	d.State, d.Attempts, d.NextAttemptAt, d.LastError = DeliveryPending, 0, t.now, ""
	return nil
}

// DeliveryWork is a claimed delivery with what sending it needs.
type DeliveryWork struct {
	ID               string
	Attempts         int
	URL              string
	SecretCiphertext []byte
	// PreviousSecretCiphertext signs too while the clock is before
	// PreviousValidUntil (a rotation's grace).
	PreviousSecretCiphertext []byte
	PreviousValidUntil       *time.Time
	Alert                    BudgetAlert
}

// DeliveryClaim takes up to limit due deliveries for one worker: it locks
// them (SKIP LOCKED: other replicas take others) and pushes their next
// attempt out to now+lease, so a worker that dies mid-send leaves them to
// be retried after the lease.
func (s *Store) DeliveryClaim(ctx context.Context, limit int, lease time.Duration) ([]DeliveryWork, error) {
	var out []DeliveryWork
	now := s.Now()
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		out = nil
		ids, err := s.q.DeliveryClaim(ctx, tx, dbsqlc.DeliveryClaimParams{Now: now, Lim: int32(limit)})
		if err != nil || len(ids) == 0 {
			return err
		}
		if err := s.q.DeliveryLease(ctx, tx, dbsqlc.DeliveryLeaseParams{LeaseUntil: now.Add(lease), Ids: ids}); err != nil {
			return err
		}
		for _, id := range ids {
			r, err := s.q.DeliveryGetWork(ctx, tx, id)
			if err != nil {
				return err
			}
			out = append(out, DeliveryWork{ID: r.DeliveryID, Attempts: int(r.Attempts), URL: r.Url, SecretCiphertext: r.SecretCiphertext,
				PreviousSecretCiphertext: r.PreviousSecretCiphertext, PreviousValidUntil: utcPtr(r.PreviousValidUntil),
				Alert: alertFromRow(dbsqlc.BudgetAlert{AlertID: r.AlertID, FiredAt: r.FiredAt, OrgID: r.OrgID, TeamID: r.TeamID,
					ScopeKind: r.ScopeKind, ScopeID: r.ScopeID, ThresholdPercent: r.ThresholdPercent, SpendMicros: r.SpendMicros,
					CapMicros: r.CapMicros, SoftMicros: r.SoftMicros, BudgetDuration: r.BudgetDuration, WindowStart: r.WindowStart,
					Region: r.Region, InstanceID: r.InstanceID, RequestID: r.RequestID})})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim alert deliveries: %w", err)
	}
	return out, nil
}

// DeliveryDone records a successful delivery.
func (s *Store) DeliveryDone(ctx context.Context, id string) error {
	if err := s.q.DeliveryDone(ctx, s.pool, dbsqlc.DeliveryDoneParams{DeliveryID: id, Now: ptrTime(s.Now())}); err != nil {
		return fmt.Errorf("record delivery %s: %w", id, err)
	}
	return nil
}

// DeliveryFailed records a failed attempt: the delivery is retried at
// next, or becomes dead once it has failed maxAttempts times.
func (s *Store) DeliveryFailed(ctx context.Context, id, lastError string, next time.Time, maxAttempts int) error {
	if err := s.q.DeliveryFailed(ctx, s.pool, dbsqlc.DeliveryFailedParams{DeliveryID: id, LastError: lastError,
		NextAttemptAt: next, MaxAttempts: int32(maxAttempts)}); err != nil {
		return fmt.Errorf("record failed delivery %s: %w", id, err)
	}
	return nil
}

func ptrTime(t time.Time) *time.Time { return &t }
