package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Tenant confines reads and writes to one org (and team); empty fields
// mean "any". Tenant-owned queries take it explicitly.
type Tenant struct {
	OrgID  string
	TeamID string
}

// Org is an organisation.
type Org struct {
	ID       string
	Name     string
	Limits   []byte // JSON of sluice.admin.v1.Limits
	Blocked  bool
	Metadata map[string]string
	// Traffic is JSON of sluice.admin.v1.OrgTraffic ("{}": nothing set);
	// it changes only through OrgTrafficSet.
	Traffic   []byte
	CreatedAt time.Time
	UpdatedAt time.Time
}

// OrgQuery filters OrgList.
type OrgQuery struct {
	NamePrefix string
	Blocked    *bool
}

func orgFromRow(r dbsqlc.Org) (Org, error) {
	md, err := decodeMetadata(r.Metadata)
	if err != nil {
		return Org{}, err
	}
	return Org{ID: r.ID, Name: r.Name, Limits: r.Limits, Blocked: r.Blocked, Metadata: md, Traffic: r.Traffic,
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}, nil
}

// OrgGet returns org id if t may see it.
func (s *Store) OrgGet(ctx context.Context, t Tenant, id string) (Org, error) {
	r, err := s.q.OrgGet(ctx, s.pool, dbsqlc.OrgGetParams{ID: id, OrgID: optStr(t.OrgID)})
	if err != nil {
		return Org{}, orNotFound(err, "org "+id)
	}
	return orgFromRow(r)
}

// OrgList returns a page of orgs visible to t, in id order.
func (s *Store) OrgList(ctx context.Context, t Tenant, q OrgQuery, p Page) ([]Org, error) {
	rows, err := s.q.OrgList(ctx, s.pool, dbsqlc.OrgListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), NamePrefix: q.NamePrefix, Blocked: q.Blocked, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list orgs: %w", err)
	}
	out := make([]Org, 0, len(rows))
	for _, r := range rows {
		o, err := orgFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, nil
}

// OrgInsert creates o; CreatedAt/UpdatedAt are set to the transaction time.
func (t *Tx) OrgInsert(ctx context.Context, o *Org) error {
	md, err := encodeMetadata(o.Metadata)
	if err != nil {
		return err
	}
	o.CreatedAt, o.UpdatedAt = t.now, t.now
	return translate(t.q.OrgInsert(ctx, t.tx, dbsqlc.OrgInsertParams{
		ID: o.ID, Name: o.Name, Limits: jsonOrEmpty(o.Limits), Metadata: md, CreatedAt: t.now,
	}))
}

// OrgGetForUpdate returns org id locked for the rest of the transaction.
func (t *Tx) OrgGetForUpdate(ctx context.Context, tn Tenant, id string) (Org, error) {
	r, err := t.q.OrgGetForUpdate(ctx, t.tx, dbsqlc.OrgGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return Org{}, orNotFound(err, "org "+id)
	}
	return orgFromRow(r)
}

// OrgUpdate writes o's name, limits and metadata.
func (t *Tx) OrgUpdate(ctx context.Context, o *Org) error {
	md, err := encodeMetadata(o.Metadata)
	if err != nil {
		return err
	}
	o.UpdatedAt = t.now
	return translate(t.q.OrgUpdate(ctx, t.tx, dbsqlc.OrgUpdateParams{
		ID: o.ID, Name: o.Name, Limits: jsonOrEmpty(o.Limits), Metadata: md, UpdatedAt: t.now,
	}))
}

// OrgSetBlocked sets o's block state.
func (t *Tx) OrgSetBlocked(ctx context.Context, o *Org, blocked bool) error {
	o.Blocked, o.UpdatedAt = blocked, t.now
	return translate(t.q.OrgSetBlocked(ctx, t.tx, dbsqlc.OrgSetBlockedParams{ID: o.ID, Blocked: blocked, UpdatedAt: t.now}))
}

// OrgDelete deletes org id. It fails with ErrFailedPrecondition while the
// org has children, naming them.
func (t *Tx) OrgDelete(ctx context.Context, id string) error {
	c, err := t.q.OrgChildren(ctx, t.tx, id)
	if err != nil {
		return fmt.Errorf("count org children: %w", err)
	}
	if n := c.Teams + c.Users + c.Keys + c.Customers + c.LabelScopes + c.AdminTokens; n > 0 {
		return &Error{Code: ErrFailedPrecondition, Msg: fmt.Sprintf(
			"org %s still has %d teams, %d users, %d keys, %d customers, %d project/tag scopes and %d admin tokens; delete them first",
			id, c.Teams, c.Users, c.Keys, c.Customers, c.LabelScopes, c.AdminTokens)}
	}
	if err := t.q.AdminTokenDeleteRevokedForOrg(ctx, t.tx, &id); err != nil {
		return fmt.Errorf("delete revoked admin tokens: %w", err)
	}
	return translate(t.q.OrgDelete(ctx, t.tx, id))
}

// orNotFound turns "no rows" into a NotFound error naming what.
func orNotFound(err error, what string) error {
	if err == nil {
		return nil
	}
	if e := translate(err); isNoRows(err) {
		return notFound(what)
	} else {
		return e
	}
}

func decodeMetadata(b []byte) (map[string]string, error) {
	md := map[string]string{}
	if len(b) == 0 {
		return md, nil
	}
	if err := json.Unmarshal(b, &md); err != nil {
		return nil, fmt.Errorf("decode metadata: %w", err)
	}
	return md, nil
}

func encodeMetadata(md map[string]string) ([]byte, error) {
	if md == nil {
		return []byte("{}"), nil
	}
	b, err := json.Marshal(md)
	if err != nil {
		return nil, fmt.Errorf("encode metadata: %w", err)
	}
	return b, nil
}

func encodeMap(m map[string]string) []byte {
	b, _ := encodeMetadata(m)
	return b
}

func jsonOrEmpty(b []byte) []byte {
	if len(b) == 0 {
		return []byte("{}")
	}
	return b
}
