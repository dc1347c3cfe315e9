package store

import (
	"context"
	"fmt"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
)

// AdminToken is a stored admin token (its hash is never returned).
type AdminToken struct {
	ID            string
	Name          string
	Scope         authz.Scope
	OrgID         string
	TeamID        string
	Role          authz.Role
	DisplayPrefix string
	Last4         string
	ExpiresAt     *time.Time
	RevokedAt     *time.Time
	CreatedBy     string
	CreatedAt     time.Time
}

// NewAdminToken is what AdminTokenInsert needs: the token's public fields
// and its hash.
type NewAdminToken struct {
	AdminToken
	Hash          []byte
	PepperVersion int
}

func adminTokenFromRow(r dbsqlc.AdminToken) (AdminToken, error) {
	scope, err := authz.ParseScope(r.Scope)
	if err != nil {
		return AdminToken{}, err
	}
	role, err := authz.ParseRole(r.Role)
	if err != nil {
		return AdminToken{}, err
	}
	return AdminToken{
		ID: r.ID, Name: r.Name, Scope: scope, OrgID: derefStr(r.OrgID), TeamID: derefStr(r.TeamID), Role: role,
		DisplayPrefix: r.DisplayPrefix, Last4: r.Last4, ExpiresAt: r.ExpiresAt, RevokedAt: r.RevokedAt,
		CreatedBy: r.CreatedBy, CreatedAt: r.CreatedAt,
	}, nil
}

// AdminTokenByHash returns the token with the given hash.
func (s *Store) AdminTokenByHash(ctx context.Context, hash []byte) (AdminToken, error) {
	r, err := s.q.AdminTokenGetByHash(ctx, s.pool, hash)
	if err != nil {
		return AdminToken{}, orNotFound(err, "admin token")
	}
	return adminTokenFromRow(r)
}

// AdminTokenList returns a page of tokens visible to t.
func (s *Store) AdminTokenList(ctx context.Context, t Tenant, includeRevoked bool, p Page) ([]AdminToken, error) {
	rows, err := s.q.AdminTokenList(ctx, s.pool, dbsqlc.AdminTokenListParams{
		AfterID: p.After, OrgID: optStr(t.OrgID), TeamID: optStr(t.TeamID), IncludeRevoked: includeRevoked, Lim: int32(p.Limit),
	})
	if err != nil {
		return nil, fmt.Errorf("list admin tokens: %w", err)
	}
	out := make([]AdminToken, 0, len(rows))
	for _, r := range rows {
		a, err := adminTokenFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// AdminTokenInsert stores a new token.
func (t *Tx) AdminTokenInsert(ctx context.Context, a *NewAdminToken) error {
	a.CreatedAt = t.now
	return translate(t.q.AdminTokenInsert(ctx, t.tx, dbsqlc.AdminTokenInsertParams{
		ID: a.ID, Name: a.Name, TokenHash: a.Hash, PepperVersion: int32(a.PepperVersion),
		DisplayPrefix: a.DisplayPrefix, Last4: a.Last4, Scope: a.Scope.String(), OrgID: optStr(a.OrgID),
		TeamID: optStr(a.TeamID), Role: a.Role.String(), ExpiresAt: a.ExpiresAt, CreatedBy: a.CreatedBy, CreatedAt: t.now,
	}))
}

// AdminTokenGetForUpdate returns token id, locked, if tn may see it.
func (t *Tx) AdminTokenGetForUpdate(ctx context.Context, tn Tenant, id string) (AdminToken, error) {
	r, err := t.q.AdminTokenGetForUpdate(ctx, t.tx, dbsqlc.AdminTokenGetForUpdateParams{ID: id, OrgID: optStr(tn.OrgID), TeamID: optStr(tn.TeamID)})
	if err != nil {
		return AdminToken{}, orNotFound(err, "admin token "+id)
	}
	return adminTokenFromRow(r)
}

// AdminTokenRevoke revokes a (not yet revoked) token.
func (t *Tx) AdminTokenRevoke(ctx context.Context, a *AdminToken) error {
	now := t.now
	a.RevokedAt = &now
	return translate(t.q.AdminTokenRevoke(ctx, t.tx, dbsqlc.AdminTokenRevokeParams{ID: a.ID, RevokedAt: &now}))
}
