package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// Label scope kinds: the key label a LabelScope limits (label_scopes.kind).
const (
	LabelKindProject = "project"
	LabelKindTag     = "tag"
)

// LabelScope is a project or a tag of an org with its own limits
// (docs/limits.md, "Project and tag scopes").
type LabelScope struct {
	ID        string
	OrgID     string
	Kind      string // LabelKindProject or LabelKindTag; immutable
	Name      string // unique per org and kind; immutable
	Limits    []byte // JSON of sluice.admin.v1.Limits
	CreatedAt time.Time
	UpdatedAt time.Time
}

// LabelScopeQuery filters LabelScopeList; empty fields match everything.
type LabelScopeQuery struct {
	Kind       string
	NamePrefix string
}

func labelScopeFromRow(r dbsqlc.LabelScope) LabelScope {
	return LabelScope{ID: r.ID, OrgID: r.OrgID, Kind: r.Kind, Name: r.Name, Limits: r.Limits, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}
}

// LabelScopeGet returns label scope id if t may see it. Label scopes are
// org-level objects: only t.OrgID confines the read.
func (s *Store) LabelScopeGet(ctx context.Context, t Tenant, id string) (LabelScope, error) {
	r, err := s.q.LabelScopeGet(ctx, s.pool, dbsqlc.LabelScopeGetParams{ID: id, OrgID: optStr(t.OrgID)})
	if err != nil {
		return LabelScope{}, orNotFound(err, "label scope "+id)
	}
	return labelScopeFromRow(r), nil
}

// LabelScopeList returns a page of label scopes visible to t, in id order.
func (s *Store) LabelScopeList(ctx context.Context, t Tenant, q LabelScopeQuery, p Page) ([]LabelScope, error) {
	rows, err := s.q.LabelScopeList(ctx, s.pool, dbsqlc.LabelScopeListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), Kind: optStr(q.Kind), NamePrefix: q.NamePrefix, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list label scopes: %w", err)
	}
	out := make([]LabelScope, 0, len(rows))
	for _, r := range rows {
		out = append(out, labelScopeFromRow(r))
	}
	return out, nil
}

// LabelScopeInsert creates l; CreatedAt/UpdatedAt are set to the
// transaction time. A second scope of the same org, kind and name is
// ErrAlreadyExists.
func (t *Tx) LabelScopeInsert(ctx context.Context, l *LabelScope) error {
	l.CreatedAt, l.UpdatedAt = t.now, t.now
	return translate(t.q.LabelScopeInsert(ctx, t.tx, dbsqlc.LabelScopeInsertParams{
		ID: l.ID, OrgID: l.OrgID, Kind: l.Kind, Name: l.Name, Limits: jsonOrEmpty(l.Limits), CreatedAt: t.now,
	}))
}

// LabelScopeGetForUpdate returns label scope id locked for the rest of
// the transaction.
func (t *Tx) LabelScopeGetForUpdate(ctx context.Context, tn Tenant, id string) (LabelScope, error) {
	r, err := t.q.LabelScopeGetForUpdate(ctx, t.tx, dbsqlc.LabelScopeGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID)})
	if err != nil {
		return LabelScope{}, orNotFound(err, "label scope "+id)
	}
	return labelScopeFromRow(r), nil
}

// LabelScopeUpdate writes l's limits (kind and name never change).
func (t *Tx) LabelScopeUpdate(ctx context.Context, l *LabelScope) error {
	l.UpdatedAt = t.now
	return translate(t.q.LabelScopeUpdate(ctx, t.tx, dbsqlc.LabelScopeUpdateParams{ID: l.ID, Limits: jsonOrEmpty(l.Limits), UpdatedAt: t.now}))
}

// LabelScopeDelete deletes label scope id.
func (t *Tx) LabelScopeDelete(ctx context.Context, id string) error {
	return translate(t.q.LabelScopeDelete(ctx, t.tx, id))
}
