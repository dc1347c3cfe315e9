package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Customer is an end customer of an org: the party on whose behalf a call
// is made, named by clients with an external id.
type Customer struct {
	ID          string
	OrgID       string
	ExternalID  string // unique within the org; immutable
	DisplayName string
	Limits      []byte // JSON of sluice.admin.v1.Limits
	Blocked     bool
	Metadata    map[string]string
	CreatedAt   time.Time
	UpdatedAt   time.Time
}

// CustomerQuery filters CustomerList.
type CustomerQuery struct {
	ExternalIDPrefix string
	Blocked          *bool
}

func customerFromRow(r dbsqlc.Customer) (Customer, error) {
	md, err := decodeMetadata(r.Metadata)
	if err != nil {
		return Customer{}, err
	}
	return Customer{ID: r.ID, OrgID: r.OrgID, ExternalID: r.ExternalID, DisplayName: r.DisplayName,
		Limits: r.Limits, Blocked: r.Blocked, Metadata: md, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}, nil
}

// CustomerGet returns customer id if t may see it. Customers are org-level
// objects: only t.OrgID confines the read.
func (s *Store) CustomerGet(ctx context.Context, t Tenant, id string) (Customer, error) {
	r, err := s.q.CustomerGet(ctx, s.pool, dbsqlc.CustomerGetParams{ID: id, OrgID: optStr(t.OrgID)})
	if err != nil {
		return Customer{}, orNotFound(err, "customer "+id)
	}
	return customerFromRow(r)
}

// CustomerList returns a page of customers visible to t, in id order.
func (s *Store) CustomerList(ctx context.Context, t Tenant, q CustomerQuery, p Page) ([]Customer, error) {
	rows, err := s.q.CustomerList(ctx, s.pool, dbsqlc.CustomerListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), ExternalIDPrefix: q.ExternalIDPrefix, Blocked: q.Blocked,
		Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list customers: %w", err)
	}
	out := make([]Customer, 0, len(rows))
	for _, r := range rows {
		c, err := customerFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// CustomerInsert creates c; CreatedAt/UpdatedAt are set to the transaction
// time.
func (t *Tx) CustomerInsert(ctx context.Context, c *Customer) error {
	md, err := encodeMetadata(c.Metadata)
	if err != nil {
		return err
	}
	c.CreatedAt, c.UpdatedAt = t.now, t.now
	return translate(t.q.CustomerInsert(ctx, t.tx, dbsqlc.CustomerInsertParams{
		ID: c.ID, OrgID: c.OrgID, ExternalID: c.ExternalID, DisplayName: c.DisplayName,
		Limits: jsonOrEmpty(c.Limits), Metadata: md, CreatedAt: t.now,
	}))
}

// CustomerGetForUpdate returns customer id locked for the rest of the
// transaction.
func (t *Tx) CustomerGetForUpdate(ctx context.Context, tn Tenant, id string) (Customer, error) {
	r, err := t.q.CustomerGetForUpdate(ctx, t.tx, dbsqlc.CustomerGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return Customer{}, orNotFound(err, "customer "+id)
	}
	return customerFromRow(r)
}

// CustomerUpdate writes c's display name, limits and metadata (the
// external id never changes).
func (t *Tx) CustomerUpdate(ctx context.Context, c *Customer) error {
	md, err := encodeMetadata(c.Metadata)
	if err != nil {
		return err
	}
	c.UpdatedAt = t.now
	return translate(t.q.CustomerUpdate(ctx, t.tx, dbsqlc.CustomerUpdateParams{
		ID: c.ID, DisplayName: c.DisplayName, Limits: jsonOrEmpty(c.Limits), Metadata: md, UpdatedAt: t.now,
	}))
}

// CustomerSetBlocked sets c's block state.
func (t *Tx) CustomerSetBlocked(ctx context.Context, c *Customer, blocked bool) error {
	c.Blocked, c.UpdatedAt = blocked, t.now
	return translate(t.q.CustomerSetBlocked(ctx, t.tx, dbsqlc.CustomerSetBlockedParams{ID: c.ID, Blocked: blocked, UpdatedAt: t.now}))
}

// CustomerDelete deletes customer id.
func (t *Tx) CustomerDelete(ctx context.Context, id string) error {
	return translate(t.q.CustomerDelete(ctx, t.tx, id))
}
